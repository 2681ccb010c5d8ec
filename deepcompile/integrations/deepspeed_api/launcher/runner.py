"""``deepspeed.launcher.runner``: the name of the environment file DeepSpeed's multi-node launcher
reads. ``accelerate launch`` imports it; single-node launches (torchrun underneath) never use it."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"

__getattr__ = module_getattr("deepspeed.launcher.runner")
