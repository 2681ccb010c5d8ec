"""``ParamShard``: this rank's piece of one partitioned parameter, in flat-range coordinates.

A leaf: the stages (``zero/sharding.py``), the full-parameter gather (``zero/gather_full.py``) and
distributed checkpoints all speak it, and none of them needs the others to name it.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False)  # a tensor field: no element-wise ==
class ParamShard:
    """This rank's piece of one partitioned parameter."""

    name: str  # the parameter's first name in ``module.named_parameters()``
    ds_id: int  # its id in the runtime's registry
    shape: torch.Size  # the full parameter's shape
    # 1-D, ``end - start`` elements, a view of the storage the stage reads: the fp32 master weights
    # of a trainable parameter (ZeRO-3 frozen parameters: their shard, in the parameter's dtype).
    # Writing it in place changes the model once ``Sharding.sync_params_from_shards`` has run.
    local: torch.Tensor
    start: int
    end: int

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return self.shape.numel()
