"""Which dtype each copy of the training state is in, decided once from the config.

Like FSDP2's ``MixedPrecisionPolicy``, one value names them all, so the engine and the ZeRO stages
read it instead of each deriving a dtype from the config:

* ``param_dtype``: what the module's floating-point parameters are cast to at ``initialize``
  (``bf16.enabled``: bfloat16, ``fp16.enabled``: float16; None: they keep the dtype they were
  built in). Forward, backward and ZeRO-3's gathers run in the parameters' dtype; buffers keep
  theirs (as in DeepSpeed: rotary ``inv_freq`` would lose precision);
* ``master_dtype``: the master weights the optimizer updates, and its state: always fp32;
* ``zero3_reduce_dtype``: what ZeRO-3 reduces trainable gradients in and keeps their partitions
  in (``communication_data_type``: fp32 unless "bf16");
* :meth:`reduce_dtype` names the reduce dtype of every stage (ZeRO-1/2: the parameter's dtype,
  into fp32 partitions) and :meth:`gather_dtype` what gathers return (the parameter's dtype), so
  the stages read both here instead of each assuming them;
* ``loss_scaling``: fp16's loss-scale settings (loss_scaler.py), None when the training dtype has
  bf16's or fp32's range and needs none.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Mapping, Optional, Union

import torch

from deepcompile.precision.loss_scaler import LossScaler, LossScaleSettings, NoLossScaling


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: Optional[torch.dtype] = None
    master_dtype: torch.dtype = torch.float32
    zero3_reduce_dtype: torch.dtype = torch.float32
    loss_scaling: Optional[LossScaleSettings] = None

    @classmethod
    def from_config(cls, config: Any) -> "PrecisionPolicy":
        """From a resolved :class:`deepcompile.Config` (``bf16``, ``fp16``,
        ``communication_data_type``). The config refuses bf16 and fp16 together."""
        param_dtype, scaling = None, None
        if config.bf16.enabled is True:
            param_dtype = torch.bfloat16
        elif config.fp16.enabled is True:
            param_dtype = torch.float16
            scaling = LossScaleSettings.from_section(config.fp16)
        reduce_dtype = torch.bfloat16 if config.communication_data_type == "bf16" else torch.float32
        return cls(param_dtype=param_dtype, zero3_reduce_dtype=reduce_dtype, loss_scaling=scaling)

    @classmethod
    def from_saved_config(cls, saved: Mapping[str, Any]) -> "PrecisionPolicy":
        """From a config recorded as a dict (``Config.to_dict()``, as a checkpoint keeps it beside
        the tensors). Sections or keys the dict lacks read as their defaults: disabled, fp32
        reductions, DeepSpeed's loss-scale settings."""
        def section(name: str, defaults: Mapping[str, Any]) -> SimpleNamespace:
            return SimpleNamespace(**{**defaults, "enabled": False, **(saved.get(name) or {})})

        scaling_defaults = dataclasses.asdict(LossScaleSettings())
        return cls.from_config(SimpleNamespace(bf16=section("bf16", {}), fp16=section("fp16", scaling_defaults),
                                               communication_data_type=saved.get("communication_data_type")))

    def gather_dtype(self, param: torch.Tensor) -> torch.dtype:
        """What a gather of ``param`` returns (ZeRO-3's all-gathers from the fp32 master shard,
        ZeRO-1/2's all-gather of the updated partitions): the parameter's own dtype, which is
        ``param_dtype`` for a floating parameter once ``initialize`` cast it. Integer or
        uncast parameters keep theirs."""
        return param.dtype

    def reduce_dtype(self, stage: int, param: torch.Tensor) -> torch.dtype:
        """What a trainable parameter's gradient is reduced in. ZeRO-3: ``zero3_reduce_dtype``
        (the runtime casts into it and allocates the partition in it). ZeRO-1/2: the parameter's
        dtype, the gradient as autograd produced it; the C++ runtime takes no reduce dtype for
        them, so the config refuses a ``communication_data_type`` that differs (config/rules.py)."""
        return self.zero3_reduce_dtype if stage == 3 else param.dtype

    def make_loss_scaler(self) -> Union[LossScaler, NoLossScaling]:
        """A fresh scaler when the policy scales the loss (fp16), else one that does nothing."""
        return NoLossScaling() if self.loss_scaling is None else LossScaler(self.loss_scaling)
