"""nn.Module internals: swapping a registered parameter for a plain tensor for one call, undoing
``nn.Module.compile``."""

from __future__ import annotations

from typing import Dict, Optional

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
