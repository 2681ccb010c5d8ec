"""``deepspeed.ops.lamb.FusedLamb``: DeepSpeed's fused LAMB kernel, imported by mmengine/xtuner's
DeepSpeed strategy to register it; it imports, and refuses when constructed (torch has no LAMB
to stand in for it as torch's Adam stands in for DeepSpeed's, ops/adam.py)."""

from typing import Any

import torch

from deepcompile.integrations.deepspeed_api._missing import module_getattr, refused


class FusedLamb(torch.optim.Optimizer):
    def __init__(self, *args: Any, **kwargs: Any):
        raise refused("deepspeed.ops.lamb.FusedLamb (DeepSpeed's fused LAMB kernel)",
                      "use a LAMB implementation that is a torch.optim.Optimizer, or torch.optim.AdamW; "
                      "deepcompile shards and steps any torch optimizer")


__getattr__ = module_getattr("deepspeed.ops.lamb")
