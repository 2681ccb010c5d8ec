"""DeepSpeed's keys as the fine-tuning projects write them (issue 29, item 3): the unprefixed
aliases of the ZeRO-3 keys, ``overlap_comm: false``, the limits and ``sub_group_size`` at 0, and
keys DeepSpeed itself ignores. Pure Python, one process."""

from __future__ import annotations

import pytest
import torch.nn as nn

from deepcompile.config import Config, ConfigError
from deepcompile.config.rules import optional_passes, reduce_overlap

# DeepSpeed's field names for the ZeRO-3 keys (its stage3_ spellings are aliases there).
ALIASES = {
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 1234),
    "param_persistence_threshold": ("stage3_param_persistence_threshold", 77),
    "max_live_parameters": ("stage3_max_live_parameters", 10**9),
    "max_reuse_distance": ("stage3_max_reuse_distance", 10**9),
    "gather_16bit_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", True),
    "stage3_gather_fp16_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", True),
}


def zero(**keys):
    return {"zero_optimization": {"stage": 3, **keys}}


def refused(d, model=None):
    try:
        Config.from_any(d).resolve(2, model)
    except ConfigError as e:
        return e
    raise AssertionError("accepted")


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_unprefixed_names_are_read_as_the_stage3_keys(alias):
    name, value = ALIASES[alias]
    assert getattr(Config.from_any(zero(**{alias: value})).zero_optimization, name) == value
    # both spellings: one value is fine, two values are an error naming both
    assert getattr(Config.from_any(zero(**{alias: value, name: value})).zero_optimization, name) == value
    other = (not value) if isinstance(value, bool) else value + 1
    e = refused(zero(**{name: value, alias: other}))
    assert e.keys == [f"zero_optimization.{alias}"]
    assert f"zero_optimization.{alias} and zero_optimization.{name} name the same setting" in str(e)
    assert "different values" in str(e)


def test_auto_through_an_alias_is_derived():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"hidden_size": 10})()
            self.lin = nn.Linear(10, 10)

    z = Config.from_any(zero(prefetch_bucket_size="auto", param_persistence_threshold="auto")).resolve(
        2, Model()).zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (90, 100)


def test_overlap_comm_false_reduces_without_overlap():
    pytest.importorskip("deepcompile.runtime")
    on = Config.from_any(zero())
    assert reduce_overlap(on) == (True, False)
    assert (on.runtime_config()["double_buffer"], on.runtime_config()["sync_after_reduce"]) == (True, False)
    off = Config.from_any(zero(overlap_comm=False))
    # DeepSpeed reduces on the compute stream then: one bucket, and the backward waits for each reduction.
    assert (off.runtime_config()["double_buffer"], off.runtime_config()["sync_after_reduce"]) == (False, True)
    # ZeRO-1/2's DeepSpeed default is false; accepted there too.
    assert Config.from_any({"zero_optimization": {"stage": 2, "overlap_comm": False}}).zero_optimization.overlap_comm is False


def test_limits_at_zero_turn_their_pass_off():
    model = nn.Linear(4, 4)
    c = Config.from_any(zero(max_live_parameters=0)).resolve(2, model)
    assert optional_passes(c) == {"selective_gather"}
    c = Config.from_any(zero(max_reuse_distance=0)).resolve(2, model)
    assert optional_passes(c) == {"prefetch"}
    c = Config.from_any(zero(max_live_parameters=10**9, max_reuse_distance=10**9)).resolve(2, model)
    assert optional_passes(c) == {"prefetch", "selective_gather"}
    # an explicit schedule that runs the pass the limit turns off is a contradiction
    d = zero(max_live_parameters=0)
    d["compile"] = {"schedule": [{"step": 1, "passes": ["prefetch"]}]}
    e = refused(d)
    assert e.keys == ["zero_optimization.stage3_max_live_parameters"] and "compile.schedule runs prefetch" in str(e)
    # any other value, binding or not, is accepted: the schedule planner keeps to it
    c = Config.from_any(zero(max_live_parameters=3, max_reuse_distance=3)).resolve(2, model)
    assert (c.zero_optimization.stage3_max_live_parameters, c.zero_optimization.stage3_max_reuse_distance) == (3, 3)
    assert optional_passes(c) == {"prefetch", "selective_gather"}


def test_sub_group_size_zero_is_one_parameter_per_group():
    assert Config.from_any(zero(sub_group_size=0)).zero_optimization.sub_group_size == 1
    assert "sub_group_size must be a non-negative integer" in str(refused(zero(sub_group_size=-1)))


def test_keys_deepspeed_ignores_are_accepted_as_objects():
    c = Config.from_any({**zero(), "monitor_config": {"enabled": True, "csv_monitor": {"enabled": False}},
                         "comms_config": {"verbose": False}})
    assert c.monitor_config == {"enabled": True, "csv_monitor": {"enabled": False}}
    assert Config.from_any(c.to_dict()) == c
    assert "monitor_config" not in Config.from_any(zero()).to_dict()
    assert "comms_config must be an object" in str(refused({**zero(), "comms_config": True}))


def test_zero_plus_plus_switches_are_accepted_off():
    Config.from_any(zero(zero_quantized_weights=False, zero_quantized_gradients=False,
                         zero_quantized_nontrainable_weights=False, zero_hpz_partition_size=1))
    e = refused(zero(zero_quantized_gradients=True))
    assert e.keys == ["zero_optimization.zero_quantized_gradients"] and "ZeRO++" in str(e)


def test_notices_name_settings_without_effect():
    d = {"zero_optimization": {"stage": 2}, "compile": {"schedule": [{"step": 0, "passes": ["prefetch"]}]}}
    assert Config.from_any(d).notices() == [
        "compile.schedule holds ZeRO-3 passes only; it has no effect with stage 2"]
    assert Config.from_any(zero()).notices() == []


class _BigParam:
    """A parameter as the config sees it (numel, dtype), without its memory."""

    def __init__(self, numel):
        import torch

        self._numel, self.dtype, self.requires_grad = numel, torch.bfloat16, True

    def numel(self):
        return self._numel

    def is_floating_point(self):
        return True


class _BigModel:
    def __init__(self, n):
        self._params = [_BigParam(n // 2), _BigParam(n - n // 2)]

    def parameters(self):
        return iter(self._params)


def test_limits_of_1e9_are_accepted_for_models_beyond_a_billion_parameters():
    # LLaMA-Factory's and ms-swift's ZeRO-3 configs set both limits to 1e9; a 7B model with them
    # runs unchanged, the schedule planner keeping to both (scheduling/planner.py).
    d = zero(stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9)
    for total in (10**9, 7 * 10**9):
        z = Config.from_any(d).resolve(2, _BigModel(total)).zero_optimization
        assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance) == (10**9, 10**9)
