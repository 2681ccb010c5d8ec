"""``deepspeed.utils``: the logger transformers sets the level of, and ZeRO-3 leaf modules."""

from __future__ import annotations

import logging
from typing import Any, List, Sequence

from deepcompile.integrations.deepspeed_api._missing import module_getattr

logger = logging.getLogger("deepcompile.deepspeed_api")


def set_z3_leaf_modules(model: Any, leaf_module_classes: Sequence[Any]) -> List[Any]:
    """accelerate calls this for MoE blocks (``transformer_moe_cls_names``): the same meaning
    as :func:`deepcompile.set_leaf_modules` (a leaf's parameters are gathered together)."""
    from deepcompile.zero.leaf_modules import set_leaf_modules  # what deepcompile.set_leaf_modules is

    return set_leaf_modules(model, list(leaf_module_classes))


__getattr__ = module_getattr("deepspeed.utils")
