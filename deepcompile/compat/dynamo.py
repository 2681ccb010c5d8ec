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


def never_compile_as_frame(fn: Callable, recursive: bool = True) -> Callable:
    """Dynamo never compiles ``fn`` as a frame of its own (``recursive``: nor anything it calls,
    which then also runs with Dynamo inactive); it still inlines ``fn`` where it traces a caller.
    Relies on ``torch._dynamo.eval_frame.set_code_exec_strategy`` and
    ``torch._dynamo.types.FrameExecStrategy``."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    code = getattr(fn, "__func__", fn).__code__
    nested = FrameAction.SKIP if recursive else FrameAction.DEFAULT
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, nested))
    return fn


class _FrameLocals:
    """What trace_rules reads of a frame it decides on: its locals."""

    def __init__(self, f_locals: dict):
        self.f_locals = f_locals


def will_compile_frame(fn: Callable) -> bool:
    """Called from eager code: True if Dynamo is active (inside ``torch.compile``d code) and would
    compile a call of ``fn`` (a function or a bound method) as a frame, False if ``fn`` would run
    eagerly (no compile region, ``torch.compiler.disable``, or code Dynamo leaves alone as a
    frame). torch 2.12 compiles the forward of torch's own modules as a frame when the module has
    hooks, torch 2.11 does not: the frame rules are asked, with the bound ``self``, where they take
    it. Relies on ``torch._C._dynamo.eval_frame.get_eval_frame_callback``,
    ``torch._dynamo.trace_rules.check`` and the ``_torchdynamo_disable`` marker."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    from torch._dynamo import trace_rules

    callback = get_eval_frame_callback()
    if callback is None or callback is False:
        return False
    func = getattr(fn, "__func__", fn)
    if getattr(fn, "_torchdynamo_disable", False) or getattr(func, "_torchdynamo_disable", False):
        return False
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    try:
        skipped = trace_rules.check(code, frame=_FrameLocals({"self": getattr(fn, "__self__", None)}))
    except TypeError:  # torch 2.11: no frame argument
        skipped = trace_rules.check(code)
    return not skipped
