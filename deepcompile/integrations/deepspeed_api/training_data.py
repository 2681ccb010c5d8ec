"""``deepspeed.initialize(training_data=, collate_fn=)``: the data loader DeepSpeed hands back
as the third result (its getting-started example trains from it).

DeepSpeed builds it from the dataset with the config's micro-batch size, a distributed sampler
over the data-parallel ranks (each rank its own rows) and the given ``collate_fn``. The loader
here is a plain ``torch.utils.data.DataLoader`` built the same way: ``batch_size`` is the engine's
``train_micro_batch_size_per_gpu``, the sampler a ``DistributedSampler`` over the world (no
shuffling, as DeepSpeed's default; ``set_epoch`` is the sampler's), the last short batch kept
(DeepSpeed's ``dataloader_drop_last`` default, false). DeepSpeed pins host memory when it trains
on a GPU; so does this loader.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


def data_loader(dataset: Any, micro_batch_size: int, collate_fn: Optional[Callable] = None,
                device: Optional[torch.device] = None) -> torch.utils.data.DataLoader:
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError("deepspeed.initialize(training_data=...): deepcompile builds the loader over a map-style "
                        f"dataset (with __len__ and __getitem__); got {type(dataset).__name__}. Build your own "
                        "DataLoader for an iterable dataset")
    if micro_batch_size is None or micro_batch_size < 1:
        raise ValueError("deepspeed.initialize(training_data=...) needs train_micro_batch_size_per_gpu (or "
                         "train_batch_size) in the config: it is the loader's batch size")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    pin = device is not None and device.type == "cuda"
    return torch.utils.data.DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler,
                                       collate_fn=collate_fn, pin_memory=pin, drop_last=False)
