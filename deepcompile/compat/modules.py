"""nn.Module internals: swapping a registered parameter for a plain tensor for one call, hooks that
run even when a forward raises, undoing ``nn.Module.compile``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn


def direct_parameters(module: nn.Module) -> Dict[str, Optional[nn.Parameter]]:
    """The parameters registered on ``module`` itself (not its children), by attribute name, as
    the live dict the module reads them from. Relies on ``nn.Module._parameters``."""
    return module._parameters


def direct_buffers(module: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """The buffers registered on ``module`` itself (not its children), by attribute name, as the
    live dict the module reads them from (``None``: registered as absent). Relies on
    ``nn.Module._buffers``."""
    return module._buffers


def swap_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Make ``module.<name>`` read ``value`` (any tensor, e.g. a non-leaf produced by an autograd
    function) until swapped back, bypassing ``nn.Module.__setattr__``'s check that a registered
    parameter is set to a Parameter. Relies on ``nn.Module._parameters``."""
    module._parameters[name] = value


def drop_module_compile(module: nn.Module) -> None:
    """Undo ``module.compile()``: calls run the plain forward again. Relies on the
    ``_compiled_call_impl`` attribute ``nn.Module.compile`` sets."""
    module._compiled_call_impl = None


def share_always_called_hooks(modules: Sequence[nn.Module]) -> Callable[[], None]:
    """Give ``modules`` one registry of their forward hooks that run even when the forward raises
    (``register_forward_hook(..., always_call=True)`` ids); returns the undo.

    Each module keeps that registry as a dict of hook ids, and Dynamo, inlining a module call,
    guards on the ids it finds there: identical layers, each with a hook of its own id, would
    then never share a compiled graph. With one registry holding every module's ids, the guard
    holds for every layer (a module runs only the hooks it has itself, so the others' ids change
    nothing). Relies on ``nn.Module._forward_hooks_always_called``.
    """
    shared: Dict[int, bool] = OrderedDict()
    for module in modules:
        shared.update(module._forward_hooks_always_called)
        module._forward_hooks_always_called = shared

    def undo() -> None:
        for module in modules:
            if module._forward_hooks_always_called is shared:
                module._forward_hooks_always_called = OrderedDict(
                    (hook_id, True) for hook_id in module._forward_hooks if hook_id in shared)

    return undo


# nn.Module._apply (what .to(), .cpu(), .half() run on every module) as torch defines it, while a
# wrapper replaces it (zero/placeholder_moves.py); None when not wrapped.
_ORIGINAL_APPLY: Optional[Callable] = None


def wrap_module_apply(make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``nn.Module._apply`` by ``make_wrapper(original)`` for every module of the process,
    until :func:`unwrap_module_apply`. Relies on ``_apply(self, fn, recurse=True)`` being the one
    path of torch's device and dtype conversions of a module (torch 2.11, 2.12)."""
    global _ORIGINAL_APPLY
    if _ORIGINAL_APPLY is None:
        _ORIGINAL_APPLY = nn.Module._apply
        nn.Module._apply = make_wrapper(_ORIGINAL_APPLY)


def unwrap_module_apply() -> None:
    global _ORIGINAL_APPLY
    if _ORIGINAL_APPLY is not None:
        nn.Module._apply = _ORIGINAL_APPLY
        _ORIGINAL_APPLY = None
