"""``deepspeed.runtime.lr_schedules``: the schedule names a DeepSpeed config may hold.

accelerate compares a scheduler object's class name with ``VALID_LR_SCHEDULES`` to tell
DeepSpeed schedules (which the engine steps) from the user's own (which accelerate steps).
deepcompile builds the three below from a config's ``scheduler`` section (optim_builder.py).
"""

from deepcompile.integrations.deepspeed_api._missing import module_getattr

WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__getattr__ = module_getattr("deepspeed.runtime.lr_schedules")
