"""Moving or casting a ZeRO-3 model keeps each placeholder one element big.

A partitioned parameter's ``.data`` is a placeholder: one element expanded to the full shape, whose
storage refuses reads (zero/partition.py). ``module.cpu()``, ``.to(dtype)``, ``.half()`` convert
every parameter through ``nn.Module._apply``; converting a placeholder would read it (an error),
and converting an expanded tensor of values would materialise it: Lightning's teardown
(``module.cpu()``) used to allocate the whole model, full size, in host memory. While any ZeRO-3
engine lives, ``_apply`` converts a stand-in of one element instead and builds a placeholder of
the result's device and dtype: the same conversion, no memory, no read. Real values of a parameter (inside
``GatheredParameters``) are not placeholders and convert as usual.

``nn.Module._apply`` is replaced for the process while engines exist (compat/modules.py), because
an instance-level override would follow a model into ``copy.deepcopy`` bound to the original and
make it unpicklable.
"""

from __future__ import annotations

import threading
from typing import List, Tuple

import torch
import torch.nn as nn

from deepcompile.compat import modules as compat_modules
from deepcompile.zero.partition import make_placeholder

_LOCK = threading.Lock()
_USERS = 0


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a placeholder: several elements over a storage of one."""
    return (t.numel() > 1 and all(s == 0 for s in t.stride())
            and t.untyped_storage().nbytes() == t.element_size())


def _shrink(module: nn.Module) -> List[Tuple[str, torch.Size]]:
    """Make each placeholder parameter of ``module`` itself a one-element view; their names and
    full shapes."""
    shrunk = []
    for name, p in compat_modules.direct_parameters(module).items():
        if p is not None and getattr(p, "ds_id", None) is not None and is_placeholder(p.data):
            shrunk.append((name, p.shape))
            p.data = torch.zeros((1,), dtype=p.dtype, device=p.device)  # a readable stand-in
    return shrunk


def _expand(module: nn.Module, shrunk: List[Tuple[str, torch.Size]]) -> None:
    params = compat_modules.direct_parameters(module)
    for name, shape in shrunk:
        p = params.get(name)  # _apply may have replaced the Parameter object
        if p is not None and p.shape != shape:
            p.data = make_placeholder(shape, p.dtype, p.device, f"ZeRO-3 parameter (ds_id {p.ds_id})")


def _apply_keeping_placeholders(original):
    def _apply(self: nn.Module, fn, *args, **kwargs):
        shrunk = _shrink(self)
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            _expand(self, shrunk)

    return _apply


def acquire() -> None:
    """A ZeRO-3 engine starts: from now until its :func:`release`, moves keep placeholders small."""
    global _USERS
    with _LOCK:
        _USERS += 1
        if _USERS == 1:
            compat_modules.wrap_module_apply(_apply_keeping_placeholders)


def release() -> None:
    global _USERS
    with _LOCK:
        if _USERS == 0:
            return
        _USERS -= 1
        if _USERS == 0:
            compat_modules.unwrap_module_apply()
