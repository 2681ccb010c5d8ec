"""Dynamo: making ``torch.compile(..., backend="deepcompile")`` resolve to our backend."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import Node


def register_backend(name: str, fn: Callable) -> None:
    """Register ``fn`` as the Dynamo backend ``name`` unless torch already resolves that name
    (an installed entry point in ``torch_dynamo_backends`` registers it lazily, by name).

    Relies on ``torch._dynamo.backends.registry.lookup_backend`` and
    ``torch._dynamo.register_backend``.
    """
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend(name)
    except Exception:  # unknown name, or an entry point that no longer imports
        torch._dynamo.register_backend(name=name)(fn)


def traced_value(node: Node) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo recorded for a node of the graph it hands to a backend (None for
    non-tensor values). Relies on Dynamo's ``node.meta["example_value"]``."""
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


def set_traced_value(node: Node, value: torch.Tensor) -> None:
    """Record ``value`` as the fake tensor of a node added to a Dynamo graph."""
    node.meta["example_value"] = value
