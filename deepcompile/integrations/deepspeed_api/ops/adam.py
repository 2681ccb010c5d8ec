"""``deepspeed.ops.adam``: DeepSpeed's Adam kernels, as the torch optimizers with the same update.

DeepSpeed's CPU Adam is a fast host implementation of Adam/AdamW for offloaded optimizer state;
with deepcompile, where the state lives follows the config (``offload_optimizer``,
docs/config.md) whatever the optimizer, so the torch optimizer with the same update serves.
``adamw_mode`` picks decoupled weight decay (AdamW) or L2 (Adam), as in DeepSpeed.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

from deepcompile.integrations.deepspeed_api._missing import missing, module_getattr


def _adam(model_params: Any, lr: float, bias_correction: bool, betas: Tuple[float, float], eps: float,
          weight_decay: float, amsgrad: bool, adamw_mode: bool, what: str) -> torch.optim.Optimizer:
    if not bias_correction:
        raise missing(f"{what}(bias_correction=False)")
    optimizer_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return optimizer_class(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


class DeepSpeedCPUAdam:
    """Constructs the torch optimizer (AdamW, or Adam with ``adamw_mode=False``)."""

    def __new__(cls, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        return _adam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
                     "deepspeed.ops.adam.DeepSpeedCPUAdam")


class FusedAdam:
    """Constructs the torch optimizer (AdamW, or Adam with ``adam_w_mode=False``)."""

    def __new__(cls, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        return _adam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode,
                     "deepspeed.ops.adam.FusedAdam")


__getattr__ = module_getattr("deepspeed.ops.adam")
