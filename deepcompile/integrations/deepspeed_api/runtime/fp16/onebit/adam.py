"""``deepspeed.runtime.fp16.onebit.adam.OnebitAdam``: imports, refuses when constructed (_refusal.py)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.fp16.onebit._refusal import RefusedOptimizer


class OnebitAdam(RefusedOptimizer):
    served_as = "deepspeed.runtime.fp16.onebit.OnebitAdam"
    instead = "torch.optim.AdamW"


__getattr__ = module_getattr("deepspeed.runtime.fp16.onebit.adam")
