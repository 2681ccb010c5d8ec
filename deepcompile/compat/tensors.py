"""Tensor-level internals: multi-tensor (foreach) kernels, storage identity, storages whose data
must not be read."""

from __future__ import annotations

from typing import List, Sequence

import torch


def foreach_norm(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The L2 norm of each tensor (0-dim tensors). Relies on ``torch._foreach_norm``."""
    return list(torch._foreach_norm(list(tensors)))


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar) -> None:
    """Multiply every tensor in place by ``scalar`` (a number or a 0-dim tensor).
    Relies on ``torch._foreach_mul_``."""
    torch._foreach_mul_(list(tensors), scalar)


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``a`` and ``b`` are views of one storage; works on fake tensors too, and on
    storages that refuse reads (ZeRO-3 placeholders: ``torch._C._is_alias_of`` compares data
    pointers, which such a storage refuses). Relies on ``UntypedStorage._cdata`` (the StorageImpl
    address), as :func:`storage_id`."""
    return storage_id(a) == storage_id(b)


def storage_id(t: torch.Tensor) -> int:
    """A key for the storage ``t`` views: equal for every view of one storage, stable while the
    storage is resized (offload frees a storage's bytes and re-allocates them in place), distinct
    for distinct live storages. Relies on ``UntypedStorage._cdata`` (the StorageImpl address)."""
    return int(t.untyped_storage()._cdata)


def storage_object(t: torch.Tensor):
    """The Python object of the storage ``t`` views, for keying a weak dictionary by storage: every
    tensor object over one storage (an alias a compiler made with ``reinterpret_tensor``, a view
    autograd saved) returns the same object while the storage lives, and it dies with the storage.
    Relies on torch keeping one Python object per StorageImpl (``UntypedStorage`` preservation)."""
    return t.untyped_storage()


def weak_id_key_dictionary():
    """A dict keyed by tensor *identity* that drops an entry when its tensor dies (a plain
    WeakKeyDictionary compares keys with ``==``, which is elementwise for tensors). Relies on
    ``torch.utils.weak.WeakIdKeyDictionary``."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def forbid_data_access(t: torch.Tensor, message: str) -> None:
    """Make every access to the data of ``t``'s storage raise ``RuntimeError(message)``: a kernel
    that reads or writes it, a copy, ``repr``, ``data_ptr()``. Metadata (shape, dtype, device,
    strides, views, fake tensors made from it) stays usable, so Dynamo still traces the tensor.
    The flag belongs to the storage, so every view shares it. A fake or meta tensor (one made
    while tracing) has no data to protect and is left alone. Relies on
    ``torch._C._set_storage_data_ptr_access_error_msg`` (what CUDA graph trees use to make reads
    of a freed output fail), which takes the StorageImpl's address, and on
    ``torch._subclasses.fake_tensor.is_fake``."""
    from torch._subclasses.fake_tensor import is_fake

    if t.is_meta or is_fake(t):
        return
    torch._C._set_storage_data_ptr_access_error_msg(t.untyped_storage()._cdata, message)
