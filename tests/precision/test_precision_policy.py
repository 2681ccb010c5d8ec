"""The dtypes of the training state, decided once from the config (deepcompile/precision/policy.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepcompile.config import Config, ConfigError
from deepcompile.precision.loss_scaler import LossScaler, NoLossScaling
from deepcompile.precision.policy import PrecisionPolicy


def config(bf16=False, fp16=False, communication_data_type=None, **fp16_keys):
    """The three config entries the policy reads, as a resolved Config holds them."""
    scaling = dict(loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                   consecutive_hysteresis=False, min_loss_scale=1.0)
    scaling.update(fp16_keys)
    return SimpleNamespace(bf16=SimpleNamespace(enabled=bf16), fp16=SimpleNamespace(enabled=fp16, **scaling),
                           communication_data_type=communication_data_type)


def test_fp32_training_keeps_the_model_dtype_and_scales_nothing():
    p = PrecisionPolicy.from_config(config())
    assert p.param_dtype is None and p.master_dtype is torch.float32 and p.zero3_reduce_dtype is torch.float32
    assert p.loss_scaling is None and isinstance(p.make_loss_scaler(), NoLossScaling)


def test_bf16_casts_parameters_and_keeps_fp32_masters_without_loss_scaling():
    p = PrecisionPolicy.from_config(config(bf16=True, communication_data_type="bf16"))
    assert p.param_dtype is torch.bfloat16 and p.master_dtype is torch.float32
    assert p.zero3_reduce_dtype is torch.bfloat16
    assert p.loss_scaling is None


def test_fp16_casts_parameters_and_scales_the_loss_with_the_sections_keys():
    p = PrecisionPolicy.from_config(config(fp16=True, initial_scale_power=5, hysteresis=1, communication_data_type="fp32"))
    assert p.param_dtype is torch.float16 and p.master_dtype is torch.float32
    assert p.zero3_reduce_dtype is torch.float32
    scaler = p.make_loss_scaler()
    assert isinstance(scaler, LossScaler) and scaler.dynamic and scaler.loss_scale == 32.0
    assert scaler.settings.hysteresis == 1
    static = PrecisionPolicy.from_config(config(fp16=True, loss_scale=128.0)).make_loss_scaler()
    assert not static.dynamic and static.loss_scale == 128.0


def test_fp16_config_is_read_with_deepspeeds_defaults():
    c = Config.from_any({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "loss_scale": 0}}).resolve(2)
    scaler = PrecisionPolicy.from_config(c).make_loss_scaler()
    assert scaler.loss_scale == 2.0 ** 16
    assert (scaler.settings.loss_scale_window, scaler.settings.hysteresis, scaler.settings.min_loss_scale) == (1000, 2, 1)


@pytest.mark.parametrize("comm,reduce_dtype", [(None, torch.float32), ("fp32", torch.float32),
                                               ("bf16", torch.bfloat16)])
def test_zero3_reduce_dtype_follows_communication_data_type(comm, reduce_dtype):
    c = Config.from_any({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                         "communication_data_type": comm})
    assert PrecisionPolicy.from_config(c).zero3_reduce_dtype is reduce_dtype


def test_every_stage_reads_its_reduce_and_gather_dtypes_from_the_policy():
    p = PrecisionPolicy.from_config(config(bf16=True, communication_data_type="bf16"))
    bf16_param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    fp32_param = torch.nn.Parameter(torch.zeros(2))
    assert p.reduce_dtype(3, fp32_param) is torch.bfloat16  # ZeRO-3: communication_data_type
    for stage in (1, 2):  # ZeRO-1/2: the parameter's dtype, whatever communication_data_type says
        assert p.reduce_dtype(stage, bf16_param) is torch.bfloat16
        assert p.reduce_dtype(stage, fp32_param) is torch.float32
    assert PrecisionPolicy().reduce_dtype(3, bf16_param) is torch.float32
    # Gathers return the parameter's dtype, not the fp32 master's.
    assert p.gather_dtype(bf16_param) is torch.bfloat16 and p.gather_dtype(fp32_param) is torch.float32


@pytest.mark.parametrize("section,dtype", [(None, None), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_saved_config_dict_gives_the_policy_of_the_config_it_came_from(section, dtype):
    d = {"zero_optimization": {"stage": 3}, "communication_data_type": "bf16" if section == "bf16" else None}
    if section is not None:
        d[section] = {"enabled": True, **({"loss_scale": 64.0} if section == "fp16" else {})}
    c = Config.from_any(d).resolve(2)
    saved = PrecisionPolicy.from_saved_config(c.to_dict())
    assert saved == PrecisionPolicy.from_config(c)
    assert saved.param_dtype is dtype
    assert (saved.loss_scaling is not None) == (section == "fp16")


def test_a_saved_config_dict_without_precision_sections_trains_in_the_stored_dtypes():
    # A checkpoint whose recorded config lacks the sections (or records none at all).
    for saved in ({}, {"bf16": None, "fp16": {"enabled": False}}):
        p = PrecisionPolicy.from_saved_config(saved)
        assert p == PrecisionPolicy() and p.param_dtype is None


@pytest.mark.parametrize("extra,key", [
    # The step in the backward updates before an overflow is known.
    ({"compile": {"optimizer_step_in_backward": True}}, "compile.optimizer_step_in_backward"),
    # ZeRO-1/2 reduce in the parameters' dtype: fp16 once fp16 casts them.
    ({"zero_optimization": {"stage": 2}, "communication_data_type": "fp32"}, "communication_data_type"),
])
def test_fp16_refuses_what_cannot_skip_an_overflow_or_reduce_as_asked(extra, key):
    d = {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}, **extra}
    with pytest.raises(ConfigError) as e:
        Config.from_any(d).resolve(2)
    assert [k for k, _ in e.value.problems] == [key], e.value.problems
    assert "fp16" in str(e.value) or "float16" in str(e.value)
