"""Process-group internals: the key-value store a process group was built with."""

from __future__ import annotations

import torch.distributed as dist


def default_store() -> "dist.Store":
    """The c10d store of the default process group (what ``init_process_group`` rendezvoused
    through: a TCPStore under torchrun and ``env://``, a FileStore with ``file://``), usually
    wrapped in a ``PrefixStore``. Relies on ``torch.distributed.distributed_c10d._get_default_store``,
    the only way to reach it: the store is not public once the group exists."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
