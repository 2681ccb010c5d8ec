"""fp16 loss scaling's state machine (deepcompile/precision/loss_scaler.py), without any process
group: DeepSpeed's meaning of every ``fp16`` key, and checkpointing of the scale."""

from __future__ import annotations

import math

import pytest
import torch

from deepcompile.precision.loss_scaler import (LossScaleAtMinimum, LossScaler, LossScaleSettings, NoLossScaling,
                                               found_overflow)


def scaler(**kw) -> LossScaler:
    return LossScaler(LossScaleSettings(**kw))


def run(s: LossScaler, overflows) -> list:
    """The scale after each update."""
    out = []
    for o in overflows:
        s.update(bool(o))
        out.append(s.loss_scale)
    return out


def test_dynamic_starts_at_two_to_the_initial_power():
    assert scaler(initial_scale_power=16).loss_scale == 65536.0
    assert scaler(initial_scale_power=3).loss_scale == 8.0


def test_static_scale_never_moves_even_on_overflow():
    s = scaler(loss_scale=128.0, loss_scale_window=1)
    assert not s.dynamic
    assert run(s, [1, 0, 0, 0, 1, 1]) == [128.0] * 6


def test_hysteresis_one_halves_at_every_overflow():
    s = scaler(initial_scale_power=10, hysteresis=1)
    assert run(s, [1, 1, 0, 1]) == [512.0, 256.0, 256.0, 128.0]


def test_hysteresis_two_tolerates_one_overflow_then_halves():
    s = scaler(initial_scale_power=10, hysteresis=2)
    assert run(s, [1]) == [1024.0]  # tolerated: the step is skipped, the scale stays
    assert s.cur_hysteresis == 1
    assert run(s, [1, 1]) == [512.0, 256.0]  # hysteresis used up: every further overflow halves


def test_without_consecutive_hysteresis_clean_steps_do_not_refill_it():
    s = scaler(initial_scale_power=10, hysteresis=2, loss_scale_window=100)
    assert run(s, [1, 0, 0, 0, 1]) == [1024.0, 1024.0, 1024.0, 1024.0, 512.0]


def test_consecutive_hysteresis_refills_at_every_clean_step():
    s = scaler(initial_scale_power=10, hysteresis=2, consecutive_hysteresis=True, loss_scale_window=100)
    assert run(s, [1, 0, 1, 0, 1]) == [1024.0] * 5  # never two overflows in a row
    assert run(s, [1]) == [512.0]


def test_scale_doubles_after_a_window_of_clean_steps():
    # As DeepSpeed: the clean step that follows `window` clean steps doubles the scale.
    s = scaler(initial_scale_power=4, hysteresis=1, loss_scale_window=3)
    assert run(s, [0, 0, 0, 0]) == [16.0, 16.0, 16.0, 32.0]
    assert run(s, [0, 0, 0]) == [32.0, 32.0, 64.0]
    # An overflow restarts the count.
    assert run(s, [1, 0, 0, 0, 0]) == [32.0, 32.0, 32.0, 32.0, 64.0]


def test_growth_refills_hysteresis():
    s = scaler(initial_scale_power=4, hysteresis=2, loss_scale_window=2)
    run(s, [1])
    assert s.cur_hysteresis == 1
    assert run(s, [0, 0, 0]) == [16.0, 16.0, 32.0]
    assert s.cur_hysteresis == 2
    assert run(s, [1]) == [32.0]  # tolerated again


def test_halving_stops_at_min_loss_scale_and_an_overflow_there_is_an_error():
    s = scaler(initial_scale_power=3, hysteresis=1, min_loss_scale=3.0)
    assert run(s, [1]) == [4.0]
    assert run(s, [1]) == [3.0]  # not below the minimum
    with pytest.raises(LossScaleAtMinimum, match="min_loss_scale"):
        s.update(True)


def test_state_dict_restores_the_scale_and_its_counters():
    settings = LossScaleSettings(initial_scale_power=6, hysteresis=2, loss_scale_window=3)
    a = LossScaler(settings)
    run(a, [1, 0, 1, 0, 0])
    b = LossScaler(settings)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.loss_scale == 32.0
    rest = [0, 0, 0, 1, 0, 0, 0, 0, 1, 1]
    assert run(b, rest) == run(a, rest)


def test_static_scale_comes_from_the_config_not_the_checkpoint():
    s = scaler(loss_scale=64.0)
    s.load_state_dict({"cur_scale": 8.0, "cur_iter": 5, "last_overflow_iter": 2, "cur_hysteresis": 1})
    assert s.loss_scale == 64.0 and s.cur_iter == 5


def test_scale_loss_and_overflow_from_the_norm():
    s = scaler(initial_scale_power=2, hysteresis=1)
    assert s.scale_loss(torch.tensor(1.5)).item() == 6.0
    assert not found_overflow(torch.tensor(3.0))
    assert found_overflow(torch.tensor(math.inf)) and found_overflow(torch.tensor(math.nan))
    assert s.after_step(torch.tensor(math.nan)) is True and s.loss_scale == 2.0
    assert s.after_step(torch.tensor(1.0)) is False and s.loss_scale == 2.0


def test_no_loss_scaling_leaves_the_loss_alone():
    none = NoLossScaling()
    loss = torch.tensor(2.0)
    assert none.scale_loss(loss) is loss and none.grad_scale is None and none.loss_scale is None
    assert none.after_step(torch.tensor(math.inf)) is False  # never reads the norm
    assert none.state_dict() == {}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        scaler(loss_scale=-1.0)
    with pytest.raises(ValueError):
        scaler(hysteresis=0)
