"""The optimizer and learning-rate schedule of an engine, from the config or from ``initialize``.

DeepSpeed builds them from the config's ``optimizer`` / ``scheduler`` sections when the caller
passes none; so does :func:`configure_optimizer` / :func:`configure_scheduler`. Passing an object
*and* having the section is an error here: DeepSpeed silently lets the object win (and has
changed which one wins for schedulers between versions), accelerate refuses the combination, and
a config section that is silently dropped is exactly what this package never does.

The schedules follow DeepSpeed's definitions (https://www.deepspeed.ai/docs/config-json/
#scheduler-parameters and ``deepspeed.runtime.lr_schedules``), re-implemented as one
``torch.optim.lr_scheduler.LRScheduler``; :class:`WarmupSchedule` states the formulas.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional

import torch
import torch.nn as nn

from deepcompile.config import AUTO, Config, OptimizerConfig, SchedulerConfig

__all__ = [
    "TESTED_OPTIMIZERS",
    "WarmupSchedule",
    "build_optimizer",
    "build_scheduler",
    "cast_floating_parameters",
    "configure_optimizer",
    "configure_scheduler",
]

# The optimizer classes deepcompile's tests train with; others need zero_allow_untested_optimizer
# (DeepSpeed's gate: an exact type check, subclasses count as untested).
TESTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def cast_floating_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """``bf16.enabled`` / ``fp16.enabled``: every floating-point parameter to ``dtype`` (the
    precision policy's ``param_dtype``), in place.

    The Parameter objects stay the same, so an optimizer already built over them stays valid.
    Buffers keep their dtype (as in DeepSpeed: e.g. rotary ``inv_freq`` would lose precision).
    """
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def build_optimizer(section: OptimizerConfig, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The torch optimizer the ``optimizer`` section describes, over ``params`` (tensors or groups)."""
    hp = section.params_dict()
    if section.type == "SGD":
        return torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"], dampening=hp["dampening"],
                               weight_decay=hp["weight_decay"], nesterov=hp["nesterov"])
    # DeepSpeed's "Adam" defaults to adam_w_mode=true: decoupled weight decay, which is AdamW.
    decoupled = section.type == "AdamW" or hp["adam_w_mode"]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"], weight_decay=hp["weight_decay"],
               amsgrad=hp["amsgrad"])


def configure_optimizer(model: nn.Module, optimizer: Any, config: Config,
                        model_parameters: Optional[Iterable[Any]] = None) -> torch.optim.Optimizer:
    """The optimizer an engine partitions: ``optimizer`` (an object, or a callable taking the
    parameters, as DeepSpeed accepts) or the one the config's ``optimizer`` section describes.

    ``model_parameters`` (tensors or param groups) defaults to the model's trainable parameters.
    """
    section = config.optimizer
    if optimizer is not None and section is not None:
        raise ValueError(
            "deepcompile.initialize got an optimizer and the config has an 'optimizer' section: give one or the "
            "other (remove the section, or pass optimizer=None to build it from the config)"
        )
    params: List[Any] = (list(model_parameters) if model_parameters is not None
                         else [p for p in model.parameters() if p.requires_grad])
    if optimizer is None:
        if section is None:
            raise ValueError(
                "deepcompile.initialize needs an optimizer: pass a torch.optim.Optimizer or add an 'optimizer' "
                "section to the config (type Adam, AdamW or SGD)"
            )
        return build_optimizer(section, params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, a callable returning one, or None; got "
                            f"{type(optimizer).__name__}")
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
        optimizer = built
    if not config.zero_allow_untested_optimizer and type(optimizer) not in TESTED_OPTIMIZERS:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in TESTED_OPTIMIZERS)
        raise ValueError(
            f"optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__} is not one deepcompile's tests "
            f"train with ({names}); set \"zero_allow_untested_optimizer\": true to use it (any torch optimizer "
            "is re-targeted at the fp32 master shards the same way)"
        )
    return optimizer


def configure_scheduler(optimizer: torch.optim.Optimizer, config: Config, lr_scheduler: Any = None) -> Any:
    """The learning-rate schedule of ``optimizer`` (the torch optimizer the engine steps): the
    config's ``scheduler`` section, or ``lr_scheduler`` (an object driving this optimizer, or a
    callable taking it), or None."""
    section = config.scheduler
    if lr_scheduler is not None and section is not None:
        raise ValueError(
            "deepcompile.initialize got an lr_scheduler and the config has a 'scheduler' section: give one or the "
            "other"
        )
    if section is not None:
        return build_scheduler(section, optimizer)
    if lr_scheduler is None:
        return None
    if not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
        lr_scheduler = lr_scheduler(optimizer)
    if not callable(getattr(lr_scheduler, "step", None)):
        raise TypeError(f"lr_scheduler must have a step() method, got {type(lr_scheduler).__name__}")
    driven = getattr(lr_scheduler, "optimizer", optimizer)
    if driven is not optimizer:
        raise ValueError("lr_scheduler drives another optimizer than the one passed to deepcompile.initialize")
    return lr_scheduler


def build_scheduler(section: SchedulerConfig, optimizer: torch.optim.Optimizer) -> "WarmupSchedule":
    return WarmupSchedule(optimizer, section.type, section.params_dict())


def _per_group(value: Any, n: int, key: str) -> List[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"scheduler.params.{key} has {len(value)} values for {n} optimizer param groups")
        return [float(v) for v in value]
    return [float(value)] * n


class WarmupSchedule(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR.

    Let ``t`` be the number of optimizer steps taken (``last_epoch``: 0 at construction, +1 per
    ``step()``), so optimizer step ``t`` runs with the value for DeepSpeed's "last batch
    iteration" ``i = t - 1``: DeepSpeed sets the learning rate for ``i = -1`` when the schedule
    is created and advances ``i`` after every optimizer step. With ``W = max(2,
    warmup_num_steps)`` and ``T = total_num_steps``, the warm-up fraction is

        w(i) = log(i + 1) / log(W)   (warmup_type "log")      w(i) = i / W   ("linear")

    for ``0 <= i < W`` and 0 for ``i < 0``. Then, per param group:

    * WarmupLR: ``lr = min + (max - min) * g`` with ``g = w(i)`` during the warm-up, 1 after it;
      ``min`` = ``warmup_min_lr``, ``max`` = ``warmup_max_lr`` (default and ``"auto"``: the
      group's learning rate when the schedule is built).
    * WarmupDecayLR: as WarmupLR, but after the warm-up ``g = max(0, (T - i) / max(1, T - W))``,
      a linear decay reaching ``min`` at ``i = T``.
    * WarmupCosineLR: ``lr = base * r`` with ``base`` the group's learning rate when the
      schedule is built, ``r = 0`` for ``i < 0``, ``r = m + (1 - m) * w(i)`` during the warm-up
      (``m`` = ``warmup_min_ratio``), after it ``r = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2)``
      with ``p = min(1, (i - W + 1) / max(1, T - W))`` and ``c`` = ``cos_min_ratio``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: dict):
        n = len(optimizer.param_groups)
        self.kind = kind
        self.warmup_steps = max(2, int(params["warmup_num_steps"]))
        self.log_warmup = params["warmup_type"] == "log"
        self.total_steps: Optional[int] = params.get("total_num_steps")
        current = [float(g["lr"]) for g in optimizer.param_groups]
        if kind == "WarmupCosineLR":
            self.peak_lrs = current
            self.warmup_min_ratio = float(params["warmup_min_ratio"])
            self.cos_min_ratio = float(params["cos_min_ratio"])
        else:
            high = params["warmup_max_lr"]
            self.min_lrs = _per_group(params["warmup_min_lr"], n, "warmup_min_lr")
            self.max_lrs = current if high is None or high == AUTO else _per_group(high, n, "warmup_max_lr")
        super().__init__(optimizer)

    def _warmup_fraction(self, i: int) -> float:
        if i < 0:
            return 0.0
        if self.log_warmup:
            return math.log(i + 1) / math.log(self.warmup_steps)
        return i / self.warmup_steps

    def lrs_at(self, t: int) -> List[float]:
        """The learning rates of optimizer step ``t`` (0-based)."""
        i, W = t - 1, self.warmup_steps
        if self.kind == "WarmupCosineLR":
            if i < 0:
                ratio = 0.0
            elif i < W:
                ratio = self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction(i)
            else:
                progress = min(1.0, (i - W + 1) / max(1, self.total_steps - W))
                c = self.cos_min_ratio
                ratio = max(0.0, c + (1.0 - c) * 0.5 * (1.0 + math.cos(math.pi * progress)))
            return [base * ratio for base in self.peak_lrs]
        if i < W:
            g = self._warmup_fraction(i)
        elif self.kind == "WarmupDecayLR":
            g = max(0.0, (self.total_steps - i) / max(1, self.total_steps - W))
        else:
            g = 1.0
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def get_lr(self) -> List[float]:  # type: ignore[override]
        return self.lrs_at(self.last_epoch)


def learning_rates(optimizer: torch.optim.Optimizer) -> List[float]:
    """The current learning rate of each param group (as DeepSpeed's ``engine.get_lr()``)."""
    return [float(g["lr"]) for g in optimizer.param_groups]

