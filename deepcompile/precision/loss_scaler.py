"""fp16 loss scaling: the factor the loss is multiplied by before the backward, and how it moves.

fp16 has a narrow range (about 6e-5 to 65504): small gradients of a real model underflow to zero.
Multiplying the loss by a large factor shifts every gradient up by the same factor; the optimizer
step divides it out again in fp32. Too large a factor makes some gradient overflow (inf or nan)
instead: that step is skipped on every rank and the factor is lowered.

:class:`LossScaler` is the state machine behind DeepSpeed's ``fp16`` section, with its meaning for
every key (``runtime/fp16/loss_scaler.py`` there):

* ``loss_scale > 0``: a static factor, never changed; an overflowed step is still skipped;
* ``loss_scale == 0``: dynamic, starting at ``2 ** initial_scale_power``;
* an overflow uses up one unit of ``hysteresis``; the overflow that finds one unit left halves
  the factor (never below ``min_loss_scale``; an overflow at the minimum is an error: training
  cannot go on without diverging);
* ``consecutive_hysteresis``: every clean step refills the hysteresis (overflows must then be
  consecutive to halve); otherwise it is refilled only when the factor grows;
* a clean step that follows ``loss_scale_window`` clean steps since the last overflow (or the
  start) doubles the factor (DeepSpeed counts the clean steps before the current one).

Deciding whether a step overflowed is the caller's (a non-finite global gradient norm, which
every rank computes from one all-reduce, so they all agree): this module has no distributed part
and is tested on its own.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Dict

import torch

log = logging.getLogger("deepcompile")

# How the dynamic factor moves: halved on overflow, doubled after a clean window (DeepSpeed's).
SCALE_FACTOR = 2.0


class LossScaleAtMinimum(RuntimeError):
    """The gradients overflowed while the loss scale was already at ``min_loss_scale``."""


@dataclasses.dataclass(frozen=True)
class LossScaleSettings:
    """The ``fp16`` section's loss-scaling keys, with DeepSpeed's defaults."""

    loss_scale: float = 0.0  # 0: dynamic; > 0: this static factor
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @classmethod
    def from_section(cls, fp16: Any) -> "LossScaleSettings":
        """From the config's ``fp16`` section (any object with these attributes)."""
        return cls(**{f.name: getattr(fp16, f.name) for f in dataclasses.fields(cls)})

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


class LossScaler:
    """The current loss scale and the counters that move it; :meth:`update` once per optimizer
    step with whether that step overflowed."""

    def __init__(self, settings: LossScaleSettings):
        if settings.loss_scale < 0 or not math.isfinite(settings.loss_scale):
            raise ValueError(f"fp16.loss_scale must be 0 (dynamic) or a positive finite number, got {settings.loss_scale}")
        if settings.dynamic and (settings.hysteresis < 1 or settings.loss_scale_window < 1):
            raise ValueError("fp16.hysteresis and fp16.loss_scale_window must be at least 1")
        self.settings = settings
        self.dynamic = settings.dynamic
        self.cur_scale = float(2 ** settings.initial_scale_power) if self.dynamic else float(settings.loss_scale)
        self.cur_iter = 0  # optimizer steps seen (overflowed or not)
        self.last_overflow_iter = -1
        self.cur_hysteresis = settings.hysteresis

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def grad_scale(self) -> float:
        """The factor this step's gradients carry, for the stage to divide out (Sharding.step)."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale

    def after_step(self, global_grad_norm: torch.Tensor) -> bool:
        """The optimizer step ended with this global norm (of the unscaled gradients): whether it
        overflowed (and so was skipped on every rank); moves the scale. Reads the norm."""
        overflow = found_overflow(global_grad_norm)
        self.update(overflow)
        return overflow

    def update(self, overflow: bool) -> None:
        """One optimizer step happened; ``overflow``: its gradients were not finite (the step was
        skipped). A static scale never moves."""
        if self.dynamic:
            if overflow:
                self._on_overflow()
            else:
                self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        s = self.settings
        if s.hysteresis == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == s.min_loss_scale:
                raise LossScaleAtMinimum(
                    f"fp16: the gradients overflowed with the loss scale already at fp16.min_loss_scale "
                    f"({s.min_loss_scale:g}); training cannot continue without diverging. Lower min_loss_scale, "
                    "lower the learning rate, or train in bf16")
            new = max(self.cur_scale / SCALE_FACTOR, s.min_loss_scale)
            log.info("fp16: gradient overflow, step skipped; loss scale %g -> %g", self.cur_scale, new)
            self.cur_scale = new
        else:
            # Tolerated: the step is skipped, the scale stays for now.
            self.cur_hysteresis -= 1
            log.info("fp16: gradient overflow, step skipped; loss scale stays %g (hysteresis %d left)",
                     self.cur_scale, self.cur_hysteresis)
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        s = self.settings
        if s.consecutive_hysteresis:
            self.cur_hysteresis = s.hysteresis
        # Clean steps since the last overflow, not counting this one: a window of them lets it grow.
        clean = self.cur_iter - self.last_overflow_iter - 1
        if clean > 0 and clean % s.loss_scale_window == 0:
            if not s.consecutive_hysteresis:
                self.cur_hysteresis = s.hysteresis
            self.cur_scale *= SCALE_FACTOR

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter, "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`). A static scale keeps the configured factor:
        the config, not the checkpoint, says what a static scale is."""
        if self.dynamic:
            self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


class NoLossScaling:
    """bf16 and fp32 training: the loss is not scaled, no step overflows, nothing is read on the
    host. The same interface as :class:`LossScaler`, so the engine has one path."""

    dynamic = False
    loss_scale = None  # not reported: nothing is scaled
    grad_scale = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after_step(self, global_grad_norm: torch.Tensor) -> bool:
        return False

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass  # a checkpoint of an fp16 run, resumed in bf16 or fp32: there is no scale to keep


def found_overflow(global_grad_norm: torch.Tensor) -> bool:
    """Whether the gradients overflowed, from their global norm (the same on every rank: one
    all-reduce of every rank's squares, so an inf or nan on any rank reaches all). Synchronises
    with the device."""
    return not bool(torch.isfinite(global_grad_norm))
