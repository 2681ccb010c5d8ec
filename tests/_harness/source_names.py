"""Reading names out of the package's source without importing it (the layering tests)."""
from __future__ import annotations

import ast


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain; a root that is not a plain name (a call, a subscript)
    is left out, so ``f().b.c`` reads ``b.c``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))
