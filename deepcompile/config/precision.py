"""The ``bf16`` and ``fp16`` sections and ``communication_data_type``: the dtypes training runs in."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from deepcompile.config import features
from deepcompile.config.inert import INERT
from deepcompile.config.schema import Section, fixed_key, inert_key, key
from deepcompile.config.validators import boolean, choice, integer, number

_FP16_REFUSED = "fp16 is not supported; use bf16 (\"bf16\": {{\"enabled\": true}})"


@dataclasses.dataclass(frozen=True)
class Bf16Config(Section):
    _path = "bf16"
    enabled: bool = key(boolean, False, "Train in bfloat16: at initialize the model's floating-point parameters are "
                        "cast to bf16 (buffers keep their dtype, as DeepSpeed does), the optimizer updates fp32 "
                        "master weights. false: the model trains in the dtype it has.",
                        auto="true when the model's floating-point parameters are bf16")
    bf16_master_weights_and_grads: bool = fixed_key("bf16.bf16_master_weights_and_grads")


def _fp16_enabled(value: Any, dotted: str) -> bool:
    if boolean(value, dotted) and not features.FP16_LOSS_SCALING:
        raise ValueError(f"{dotted}: " + _FP16_REFUSED.format())
    return value


def _scaling_key(name: str, check, default: Any, doc: str):
    """A loss-scaling key: inert while fp16 is refused (features.FP16_LOSS_SCALING), else read."""
    dotted = f"fp16.{name}"
    return inert_key(dotted, check, default) if dotted in INERT else key(check, default, doc)


@dataclasses.dataclass(frozen=True)
class Fp16Config(Section):
    """``fp16``: DeepSpeed's keys and defaults for fp16 with loss scaling."""

    _path = "fp16"
    enabled: bool = key(_fp16_enabled, False, "fp16 training with DeepSpeed's loss scaling (deepcompile/precision/): "
                        "parameters cast to fp16, fp32 masters; an overflow skips the step on every rank. fp16 and "
                        "bf16 together are an error.",
                        auto="true when the model's floating-point parameters are fp16")
    auto_cast: bool = fixed_key("fp16.auto_cast")
    loss_scale: float = _scaling_key("loss_scale", number(0.0), 0.0,
                                     "0: dynamic loss scaling; > 0: this static scale.")
    initial_scale_power: int = _scaling_key("initial_scale_power", integer(0), 16,
                                            "Dynamic scaling starts at 2 ** initial_scale_power.")
    loss_scale_window: int = _scaling_key("loss_scale_window", integer(1), 1000,
                                          "Steps without overflow after which the dynamic scale doubles.")
    hysteresis: int = _scaling_key("hysteresis", integer(1), 2,
                                   "Overflows tolerated before the dynamic scale is lowered.")
    consecutive_hysteresis: bool = _scaling_key("consecutive_hysteresis", boolean, False,
                                                "Refill the hysteresis after a step without overflow.")
    min_loss_scale: float = _scaling_key("min_loss_scale", number(0.0, low_open=True), 1.0,
                                         "The dynamic scale never goes below this.")
    fp16_master_weights_and_grads: bool = fixed_key("fp16.fp16_master_weights_and_grads")

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0


def communication_data_type(value: Any, dotted: str) -> Optional[str]:
    if value is None:
        return None
    if value == "fp16":
        raise ValueError(f"{dotted}=\"fp16\" is not supported: an fp16 reduce of bf16/fp32 gradients can overflow "
                         "without loss scaling; use \"bf16\" or \"fp32\"")
    return choice("fp32", "bf16")(value, dotted)
