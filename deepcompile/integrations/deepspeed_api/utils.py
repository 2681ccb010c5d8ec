"""``deepspeed.utils``: the logger transformers sets the level of, ZeRO-3 leaf modules, the
``logging`` submodule (ds_logging.py), the ``groups`` submodule (ds_groups.py: the
sequence-parallel group accessors), the ``zero_to_fp32`` submodule (zero_to_fp32.py: the full
fp32 weights of a checkpoint, offline), and the full-value accessors peft's AdaLoRA calls, refused."""

from __future__ import annotations

from typing import Any, List, Sequence

from deepcompile.integrations.deepspeed_api import ds_groups as groups  # noqa: F401 - deepspeed.utils.groups
from deepcompile.integrations.deepspeed_api import ds_logging as logging  # deepspeed.utils.logging
from deepcompile.integrations.deepspeed_api import zero_to_fp32  # noqa: F401 - deepspeed.utils.zero_to_fp32
from deepcompile.integrations.deepspeed_api._missing import module_getattr, refused
from deepcompile.integrations.deepspeed_api.ds_logging import log_dist, logger  # noqa: F401


def set_z3_leaf_modules(model: Any, leaf_module_classes: Sequence[Any]) -> List[Any]:
    """accelerate calls this for MoE blocks (``transformer_moe_cls_names``): the same meaning
    as :func:`deepcompile.set_leaf_modules` (a leaf's parameters are gathered together)."""
    from deepcompile.zero.leaf_modules import set_leaf_modules  # what deepcompile.set_leaf_modules is

    return set_leaf_modules(model, list(leaf_module_classes))


# DeepSpeed's full-value accessors read a parameter's fp32 master or reduced gradient wherever its
# stage keeps them. deepcompile's are not reachable from a parameter: ZeRO-1/2 parameters are not
# registered anywhere the served package can find their stage, gradients between micro-steps live
# in the runtime's buffers, and a ZeRO-3 gather gives the training dtype, not the fp32 master.
# They are served so that the import succeeds, and refuse when called.

def safe_get_full_grad(param: Any) -> Any:
    raise refused("deepspeed.utils.safe_get_full_grad (gradients are reduced into partitions inside deepcompile's "
                  "runtime, with no per-parameter full gradient to read)",
                  "peft's AdaLoRA needs it for its importance scores: train AdaLoRA without ZeRO, or use LoRA")


def safe_get_full_fp32_param(param: Any) -> Any:
    raise refused("deepspeed.utils.safe_get_full_fp32_param",
                  "read the full value inside deepspeed.zero.GatheredParameters([param]) (in the training "
                  "dtype), or the fp32 weights from the engine's checkpoint")


def safe_set_full_fp32_param(param: Any, value: Any) -> None:
    raise refused("deepspeed.utils.safe_set_full_fp32_param",
                  "under ZeRO-3, write the value inside deepspeed.zero.GatheredParameters([param], modifier_rank=0) "
                  "(that rank's values go into every rank's fp32 shard); ZeRO-1/2 have no equivalent")


__getattr__ = module_getattr("deepspeed.utils")
