"""``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``: as torch's Adagrad (see ops/adam.py for why)."""

from __future__ import annotations

from typing import Any

import torch

from deepcompile.integrations.deepspeed_api._missing import module_getattr


class DeepSpeedCPUAdagrad:
    def __new__(cls, model_params: Any, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                amsgrad: bool = False, fp32_optimizer_states: bool = True):
        return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__getattr__ = module_getattr("deepspeed.ops.adagrad")
