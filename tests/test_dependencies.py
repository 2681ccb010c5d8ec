"""How the package's modules may depend on each other and on torch (read from the source, no import).

* Nothing below the engine imports it: ``compiler/``, ``scheduling/``, ``passes/``,
  ``profiling/``, ``zero/`` and ``compat/`` are usable without an ``Engine``.
* ``scheduling/`` does not import ``compiler/``, and ``passes/`` imports neither: the backend
  drives the scheduler and the passes, not the other way around.
* Private torch surface (``torch._*``, ``torch.utils._*``, ``functorch``) is reached only from
  ``compat/``, so that a torch upgrade breaks in one place.
"""

from __future__ import annotations

import ast
import os
from typing import Iterator, List, Tuple

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deepcompile")


def _modules() -> Iterator[Tuple[str, ast.AST]]:
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PACKAGE).replace(os.sep, "/"), ast.parse(f.read(), path)


def _imports(tree: ast.AST) -> List[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _private_torch(name: str) -> bool:
    parts = name.split(".")
    if parts[:2] == ["torch", "ops"]:
        return False  # operator names (aten._to_copy) are the IR, not private Python surface
    return (parts[0] == "functorch"
            or (parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])))


MODULES = dict(_modules())


@pytest.mark.parametrize("layer", ["compiler/", "scheduling/", "passes/", "profiling/", "zero/", "compat/"])
def test_nothing_below_the_engine_imports_it(layer):
    offenders = [path for path, tree in MODULES.items() if path.startswith(layer)
                 and any(name == "deepcompile.engine" or name.startswith("deepcompile.engine.") for name in _imports(tree))]
    assert not offenders, f"{offenders} import deepcompile.engine"


@pytest.mark.parametrize("layer,forbidden", [
    ("scheduling/", ("deepcompile.compiler",)),
    ("passes/", ("deepcompile.compiler", "deepcompile.scheduling")),
    ("profiling/", ("deepcompile.compiler", "deepcompile.scheduling", "deepcompile.passes")),
])
def test_dependencies_point_one_way(layer, forbidden):
    offenders = [(path, name) for path, tree in MODULES.items() if path.startswith(layer)
                 for name in _imports(tree) if name.startswith(forbidden)]
    assert not offenders, offenders


def test_private_torch_only_in_compat():
    offenders = []
    for path, tree in MODULES.items():
        if path.startswith("compat/"):
            continue
        names = _imports(tree) + [_dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
        offenders += [(path, name) for name in names if _private_torch(name)]
    assert not offenders, f"private torch used outside deepcompile/compat/: {sorted(set(offenders))}"
