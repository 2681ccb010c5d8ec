"""Dynamo: making ``torch.compile(..., backend="deepcompile")`` resolve to our backend."""

from __future__ import annotations

from typing import Callable


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
