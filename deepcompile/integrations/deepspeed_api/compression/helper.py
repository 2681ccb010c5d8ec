"""``deepspeed.compression.helper.recursive_getattr/recursive_setattr``: DeepSpeed-Chat's LoRA
conversion reaches submodules by dotted name ("decoder.layers.0.fc1") with them."""

from functools import reduce
from typing import Any

from deepcompile.integrations.deepspeed_api._missing import module_getattr


def recursive_getattr(model: Any, module_name: str) -> Any:
    return reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    parent_path, _, last = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_path) if parent_path else model
    setattr(parent, last, module)


__getattr__ = module_getattr("deepspeed.compression.helper")
