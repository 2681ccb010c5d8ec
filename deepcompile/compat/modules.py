"""nn.Module internals: swapping a registered parameter for a plain tensor for one call, and hooks
on every module."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

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


def register_global_forward_pre_hook(hook: Callable) -> Any:
    """A forward pre-hook for every module (``hook(module, args)``); returns its handle.
    Relies on ``torch.nn.modules.module.register_module_forward_pre_hook``."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    return register_module_forward_pre_hook(hook)


def register_global_forward_hook(hook: Callable, always_call: bool = False) -> Any:
    """A forward hook for every module (``hook(module, args, output)``), also run when the
    forward raises if ``always_call``; returns its handle. Relies on
    ``torch.nn.modules.module.register_module_forward_hook``."""
    from torch.nn.modules.module import register_module_forward_hook

    return register_module_forward_hook(hook, always_call=always_call)


def drop_module_compile(module: nn.Module) -> None:
    """Undo ``module.compile()``: calls run the plain forward again. Relies on the
    ``_compiled_call_impl`` attribute ``nn.Module.compile`` sets."""
    module._compiled_call_impl = None
