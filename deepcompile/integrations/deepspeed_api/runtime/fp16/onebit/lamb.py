"""``deepspeed.runtime.fp16.onebit.lamb.OnebitLamb``: imports, refuses when constructed (_refusal.py)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.fp16.onebit._refusal import RefusedOptimizer


class OnebitLamb(RefusedOptimizer):
    served_as = "deepspeed.runtime.fp16.onebit.OnebitLamb"
    instead = "a LAMB that is a torch.optim.Optimizer, or torch.optim.AdamW"


__getattr__ = module_getattr("deepspeed.runtime.fp16.onebit.lamb")
