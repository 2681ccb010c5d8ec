"""Config values DeepSpeed accepts, as clients hand them over (issue 50, item 2): read as DeepSpeed
reads them (docs/migrating-from-deepspeed.md, "Config values at the edges").

* ``scheduler.params.warmup_num_steps: 0``: what HF Trainer and accelerate's DummyScheduler fill
  in without warm-up in the releases before they clamp it to 1; DeepSpeed before 0.19.3 read it
  as 2 steps (``max(2, warmup_num_steps)``), and so does deepcompile.
* The WarmupCosineLR ratios outside [0, 1], which DeepSpeed takes as they are.
* Two spellings of one key: an ``"auto"`` spelling next to a value (DeepSpeed drops ``"auto"``
  values before reading a section), and ``bf16`` next to its old name ``bfloat16`` (DeepSpeed
  reads ``bfloat16`` only without ``bf16``).

Pure Python, one process.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

from deepcompile.config import Config, ConfigError
from deepcompile.optim_builder import build_scheduler


def _config(**sections):
    return Config.from_any({"zero_optimization": {"stage": 3}, **sections})


def _scheduler(kind, **params):
    return _config(scheduler={"type": kind, "params": params}).scheduler


def _lrs(kind, steps, lr=0.1, **params):
    """The learning rate of optimizer steps 0..steps-1, stepping as the engine does."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(_scheduler(kind, **params), opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


# DeepSpeed's schedules (runtime/lr_schedules.py), as functions of its "last batch iteration" i:
# -1 when the schedule is built, +1 after each optimizer step; so optimizer step t runs with i = t - 1.
def _ds_warmup_gamma(i, warmup, log):
    w = max(2, warmup)
    if log:
        return math.log(i + 1) / math.log(w)
    return i / w


def _ds_warmup_decay_lr(i, lo, hi, warmup, total, log=True):
    w = max(2, warmup)
    if i < 0:
        return lo
    gamma = _ds_warmup_gamma(i, warmup, log) if i < w else max(0.0, (total - i) / max(1.0, total - w))
    return lo + (hi - lo) * gamma


def _ds_warmup_cosine_ratio(i, warmup, total, warmup_min_ratio, cos_min_ratio, log=True):
    w = max(2, warmup)
    if i < 0:
        return 0.0
    if i < w:
        return warmup_min_ratio + (1 - warmup_min_ratio) * _ds_warmup_gamma(i, warmup, log)
    progress = min(1.0, (i - w + 1) / max(1, total - w))
    return max(0.0, cos_min_ratio + (1 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


@pytest.mark.parametrize("kind, extra", [("WarmupLR", {}), ("WarmupDecayLR", {"total_num_steps": 10}),
                                         ("WarmupCosineLR", {"total_num_steps": 10})])
def test_warmup_num_steps_zero_is_accepted(kind, extra):
    assert _scheduler(kind, warmup_num_steps=0, **extra).params_dict()["warmup_num_steps"] == 0
    # a negative length is still refused (DeepSpeed 0.19.3 and later refuse it too)
    with pytest.raises(ConfigError) as e:
        _scheduler(kind, warmup_num_steps=-1, **extra)
    assert e.value.keys == ["scheduler.params.warmup_num_steps"]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_zero_learning_rates_follow_deepspeed(warmup_type):
    lo, hi, total = 0.01, 0.1, 8
    got = _lrs("WarmupDecayLR", 12, warmup_num_steps=0, total_num_steps=total, warmup_min_lr=lo,
               warmup_max_lr=hi, warmup_type=warmup_type)
    want = [_ds_warmup_decay_lr(t - 1, lo, hi, 0, total, log=warmup_type == "log") for t in range(12)]
    assert got == pytest.approx(want, abs=1e-12)
    # warm-up 0 acts as 2 steps: the first two optimizer steps run at the minimum
    assert got[:2] == pytest.approx([lo, lo]) and got[2] > lo
    assert got == pytest.approx(_lrs("WarmupDecayLR", 12, warmup_num_steps=2, total_num_steps=total,
                                     warmup_min_lr=lo, warmup_max_lr=hi, warmup_type=warmup_type))

    got = _lrs("WarmupCosineLR", 8, lr=0.2, warmup_num_steps=0, total_num_steps=6)
    want = [0.2 * _ds_warmup_cosine_ratio(t - 1, 0, 6, 0.0, 1e-4) for t in range(8)]
    assert got == pytest.approx(want, abs=1e-12)


def test_cosine_ratios_outside_zero_one_follow_deepspeed():
    for warmup_min_ratio, cos_min_ratio in ((1.5, 1e-4), (0.0, -0.5), (0.0, 2.0)):
        got = _lrs("WarmupCosineLR", 12, lr=0.2, warmup_num_steps=3, total_num_steps=9,
                   warmup_min_ratio=warmup_min_ratio, cos_min_ratio=cos_min_ratio)
        want = [0.2 * _ds_warmup_cosine_ratio(t - 1, 3, 9, warmup_min_ratio, cos_min_ratio) for t in range(12)]
        assert got == pytest.approx(want, abs=1e-12), (warmup_min_ratio, cos_min_ratio)
        assert min(got) >= 0.0
    # a negative warm-up start would make the first steps' learning rate negative: still refused
    with pytest.raises(ConfigError) as e:
        _scheduler("WarmupCosineLR", total_num_steps=9, warmup_min_ratio=-0.5)
    assert e.value.keys == ["scheduler.params.warmup_min_ratio"]


# DeepSpeed's ZeRO spellings (alias, key as deepcompile names it, a value that is not the default)
_ZERO_SPELLINGS = [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 1234),
    ("param_persistence_threshold", "stage3_param_persistence_threshold", 77),
    ("max_live_parameters", "stage3_max_live_parameters", 5000),
    ("max_reuse_distance", "stage3_max_reuse_distance", 6000),
    ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
    ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", True),
]


@pytest.mark.parametrize("alias, name, value", _ZERO_SPELLINGS)
def test_an_auto_spelling_gives_way_to_a_value(alias, name, value):
    for zero in ({alias: "auto", name: value}, {name: "auto", alias: value}, {alias: value, name: "auto"}):
        z = Config.from_any({"zero_optimization": {"stage": 3, **zero}}).zero_optimization
        assert getattr(z, name) == value, zero
    # two values under two spellings stay refused (DeepSpeed refuses a second spelling whatever its value)
    other = (not value) if isinstance(value, bool) else value + 1
    with pytest.raises(ConfigError) as e:
        Config.from_any({"zero_optimization": {"stage": 3, name: value, alias: other}})
    assert e.value.keys == [f"zero_optimization.{alias}"]


def test_bf16_is_read_before_its_old_name():
    with pytest.warns(UserWarning, match="bfloat16 is ignored: bf16 is given too"):
        c = _config(bf16={"enabled": True}, bfloat16={"enabled": False})
    assert c.bf16.enabled is True
    with pytest.warns(UserWarning, match="bfloat16 is ignored"):
        assert _config(bfloat16={"enabled": True}, bf16={"enabled": False}).bf16.enabled is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # "bf16": null is no bf16 section for DeepSpeed, which then reads "bfloat16"
        assert _config(bf16=None, bfloat16={"enabled": True}).bf16.enabled is True
        assert _config(bf16={"enabled": True}, bfloat16={"enabled": True}).bf16.enabled is True
