"""``deepcompile.config``: parsing, defaults, strict validation and error messages of the user
config (DeepSpeed's JSON keys), and its mapping onto the runtime settings. Pure Python, one process.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from _harness.paths import ROOT

from deepcompile.config import (
    ActivationCheckpointingConfig,
    Bf16Config,
    CompileConfig,
    Config,
    ConfigError,
    CsvMonitorConfig,
    FaultToleranceConfig,
    Fp16Config,
    HybridEngineConfig,
    OptimizerConfig,
    SchedulerConfig,
    TensorboardConfig,
    WandbConfig,
    ZeroConfig,
)

SECTIONS = (Config, ZeroConfig, CompileConfig, Bf16Config, Fp16Config, OptimizerConfig, SchedulerConfig,
            ActivationCheckpointingConfig, TensorboardConfig, CsvMonitorConfig, WandbConfig, HybridEngineConfig,
            FaultToleranceConfig)

Z3 = {"zero_optimization": {"stage": 3}}


def make(**top):
    """A dict config with ZeRO-3 plus the given top-level entries."""
    return {**Z3, **top}


def err(d) -> str:
    with pytest.raises(ValueError) as e:
        Config.from_any(d)
    return str(e.value)


# ------------------------------------------------------------------------------------ defaults


def test_defaults():
    c = Config.from_dict(Z3)
    assert c.train_micro_batch_size_per_gpu is None
    assert c.train_batch_size is None
    assert c.gradient_accumulation_steps is None  # unset: derived at initialize (1 here)
    assert c.resolve(world_size=2).gradient_accumulation_steps == 1
    assert c.gradient_clipping == 0.0
    assert c.steps_per_print == 10
    assert c.wall_clock_breakdown is False
    assert c.bf16 == Bf16Config(enabled=False)
    assert c.fp16 == Fp16Config(enabled=False)
    assert c.optimizer is None and c.scheduler is None
    assert c.communication_data_type is None
    assert c.prescale_gradients is False and c.gradient_predivide_factor == 1.0
    assert c.zero_allow_untested_optimizer is False

    z = c.zero_optimization
    assert z.stage == 3
    assert z.reduce_bucket_size == 500_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.offload_param is None and z.offload_optimizer is None
    assert z.overlap_comm and z.contiguous_gradients and z.allgather_partitions and z.reduce_scatter
    assert not z.round_robin_gradients and not z.memory_efficient_linear
    assert z.stage3_max_live_parameters is None and z.stage3_max_reuse_distance is None and z.sub_group_size is None

    k = c.compile
    assert k.deepcompile is True
    assert k.free_activation is False
    assert k.free_activation_threshold == 10 * 1024 * 1024
    assert not (k.offload_activation or k.offload_opt_states or k.offload_parameters or k.symmetric_memory)
    assert k.double_buffer is True
    assert k.debug_log is False
    assert k.report_dir is None
    assert not (k.sync_before_reduce or k.sync_after_reduce or k.sync_before_allgather or k.sync_after_allgather)
    assert k.keep_int_input_tensors is True and k.keep_all_input_tensors is False
    assert k.warmup_steps == 5
    assert k.prefetch is True and k.selective_gather is True
    assert k.memory_budget_fraction == 0.9


def test_every_field_is_documented_and_has_a_validator():
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"], (cls.__name__, f.name)
            assert callable(f.metadata["check"]), (cls.__name__, f.name)


# ------------------------------------------------------------------------------------ inputs

FULL = {
    "train_micro_batch_size_per_gpu": 4,
    "train_batch_size": 32,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 5,
    "wall_clock_breakdown": True,
    "communication_data_type": "fp32",
    "bf16": {"enabled": True},
    "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
    "activation_checkpointing": {"partition_activations": False, "number_checkpoints": None},
    "tensorboard": {"enabled": False, "output_path": "/tmp/tb"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 0,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_live_parameters": 10,
        "stage3_max_reuse_distance": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
        "sub_group_size": 1e9,
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "none", "pin_memory": True},
    },
    "compile": {
        "deepcompile": True,
        "free_activation": True,
        "free_activation_threshold": 1024,
        "offload_activation": False,
        "offload_opt_states": False,
        "offload_parameters": False,
        "symmetric_memory": False,
        "double_buffer": False,
        "debug_log": True,
        "report_dir": "/tmp/dc",
        "sync_before_reduce": True,
        "sync_after_reduce": False,
        "sync_before_allgather": True,
        "sync_after_allgather": False,
        "keep_int_input_tensors": True,
        "keep_all_input_tensors": False,
        "warmup_steps": 0,
        "prefetch": False,
        "selective_gather": False,
        "memory_budget_fraction": 1,
    },
}


def test_dict_file_and_config_inputs_are_equal(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(FULL))
    from_dict = Config.from_any(FULL)
    from_str = Config.from_any(str(path))
    from_pathlike = Config.from_any(pathlib.Path(path))
    assert from_dict == from_str == from_pathlike == Config.from_dict(FULL)
    assert Config.from_any(from_dict) is from_dict


def test_full_values_are_normalized():
    c = Config.from_any(FULL)
    assert c.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(c.zero_optimization.reduce_bucket_size) is int
    assert type(c.zero_optimization.sub_group_size) is int
    assert c.optimizer.params_dict()["betas"] == (0.9, 0.95)
    assert c.optimizer.params_dict()["eps"] == 1e-8  # defaults filled in
    assert c.scheduler.params_dict()["cos_min_ratio"] == 1e-4
    assert c.compile.memory_budget_fraction == 1.0 and type(c.compile.memory_budget_fraction) is float
    assert c.bf16.enabled is True
    assert c.compile.report_dir == "/tmp/dc"


def test_from_any_rejects_other_types():
    for bad in (None, 3, [("zero_optimization", {"stage": 3})], b"{}"):
        with pytest.raises(TypeError, match="dict, a path to a JSON file or a deepcompile.Config"):
            Config.from_any(bad)
    with pytest.raises(TypeError):
        Config.from_dict([1, 2])


def test_bad_json_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        Config.from_any(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        Config.from_any(arr)
    with pytest.raises(FileNotFoundError):
        Config.from_any(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("d", [Z3, FULL], ids=["defaults", "full"])
def test_round_trip(d):
    c = Config.from_dict(d)
    out = c.to_dict()
    assert Config.from_dict(out) == c
    assert json.loads(json.dumps(out)) == out  # JSON-serializable
    assert out["zero_optimization"]["stage"] == c.zero_optimization.stage
    assert set(out["compile"]) == {f.name for f in dataclasses.fields(CompileConfig)}


def test_config_is_immutable_and_replace_validates():
    c = Config.from_dict(Z3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gradient_clipping = 1.0
    c2 = dataclasses.replace(c, compile=dataclasses.replace(c.compile, prefetch=False))
    assert c2.compile.prefetch is False and c.compile.prefetch is True
    with pytest.raises(ValueError, match="compile.warmup_steps must be a non-negative integer, got -1"):
        dataclasses.replace(c.compile, warmup_steps=-1)
    assert hash(c) == hash(Config.from_dict(Z3))


# ------------------------------------------------------------------------------------ errors


def test_unknown_top_level_key():
    msg = err(make(amp={"enabled": False}))
    assert "'amp'" in msg
    for k in ("zero_optimization", "compile", "bf16", "train_batch_size", "gradient_clipping", "optimizer"):
        assert k in msg


def test_unknown_nested_key_names_the_dotted_path_and_lists_supported_keys():
    msg = err({"zero_optimization": {"stage": 3, "stgae": 3}})
    assert "zero_optimization.stgae" in msg
    assert "did you mean 'stage'" in msg
    for f in dataclasses.fields(ZeroConfig):
        assert f.name in msg

    msg = err(make(compile={"prefetchh": True}))
    assert "compile.prefetchh" in msg
    for f in dataclasses.fields(CompileConfig):
        assert f.name in msg

    assert "bf16.enable" in err(make(bf16={"enable": True}))
    assert "zero_optimization.offload_param.dev" in err(
        {"zero_optimization": {"stage": 3, "offload_param": {"dev": "none"}}})


@pytest.mark.parametrize(
    "d, expected",
    [
        # bool keys reject ints and strings
        (make(bf16={"enabled": 1}), "bf16.enabled must be true or false, got 1 (int)"),
        (make(compile={"prefetch": "yes"}), "compile.prefetch must be true or false, got 'yes' (str)"),
        (make(wall_clock_breakdown=0), "wall_clock_breakdown must be true or false"),
        ({"zero_optimization": {"stage": 3, "overlap_comm": None}}, "zero_optimization.overlap_comm"),
        (make(communication_data_type="float32"), "communication_data_type must be one of 'fp32', 'bf16'"),
        # int keys reject bools, non-integral floats, strings and out-of-range values
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": -3}},
         "zero_optimization.reduce_bucket_size must be a positive integer, got -3"),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0}},
         "zero_optimization.reduce_bucket_size must be a positive integer, got 0"),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": True}},
         "zero_optimization.reduce_bucket_size must be a positive integer, got True (bool)"),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1.5}},
         "zero_optimization.reduce_bucket_size must be a positive integer, got 1.5"),
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "5e8"}},
         "zero_optimization.reduce_bucket_size must be a positive integer, got '5e8' (str)"),
        ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -1}},
         "zero_optimization.stage3_param_persistence_threshold must be a non-negative integer, got -1"),
        ({"zero_optimization": {"stage": 3, "allgather_bucket_size": 0}},
         "zero_optimization.allgather_bucket_size must be a positive integer"),
        ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1}},
         "zero_optimization.stage3_max_live_parameters must be a non-negative integer"),
        (make(gradient_accumulation_steps=0), "gradient_accumulation_steps must be a positive integer, got 0"),
        (make(train_batch_size=False), "train_batch_size must be a positive integer, got False (bool)"),
        (make(train_micro_batch_size_per_gpu=2.5), "train_micro_batch_size_per_gpu must be a positive integer"),
        (make(steps_per_print=0), "steps_per_print must be a positive integer"),
        (make(compile={"warmup_steps": -1}), "compile.warmup_steps must be a non-negative integer, got -1"),
        (make(compile={"free_activation_threshold": float("inf")}),
         "compile.free_activation_threshold must be a non-negative integer"),
        # float keys
        (make(gradient_clipping=-0.5), "gradient_clipping must be a number >= 0.0, got -0.5"),
        (make(gradient_clipping=True), "gradient_clipping must be a number >= 0.0, got True (bool)"),
        (make(gradient_clipping=float("nan")), "gradient_clipping must be a number >= 0.0"),
        (make(compile={"memory_budget_fraction": 0}), "compile.memory_budget_fraction must be a number in (0.0, 1.0], got 0.0"),
        (make(compile={"memory_budget_fraction": 1.01}), "compile.memory_budget_fraction must be a number in (0.0, 1.0]"),
        (make(compile={"memory_budget_fraction": "0.5"}), "compile.memory_budget_fraction must be a number"),
        # strings
        (make(compile={"report_dir": 3}), "compile.report_dir must be a string or null, got 3 (int)"),
        # sections must be objects
        ({"zero_optimization": 3}, "zero_optimization must be an object, got 3 (int)"),
        (make(compile=None), "compile must be an object"),
    ],
)
def test_wrong_types_and_ranges(d, expected):
    assert expected in err(d)


def test_steps_per_print_infinity_means_never(tmp_path):
    # accelerate always writes float("inf"); a JSON file spells it Infinity (Python's json reads
    # that as the same float). Both stay infinity through to_dict and a second parse.
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3}, "steps_per_print": Infinity}')
    for given in (make(steps_per_print=float("inf")), str(path)):
        c = Config.from_any(given)
        assert c.steps_per_print == float("inf")
        assert Config.from_any(c.to_dict()).steps_per_print == float("inf")


def test_steps_per_print_infinity_logs_no_step_line():
    import torch

    from deepcompile.step_report import StepReport

    never = StepReport(Config.from_any(make(steps_per_print=float("inf"))).steps_per_print, False, 0,
                       torch.device("cpu"))
    every = StepReport(1, False, 0, torch.device("cpu"))
    for step in range(1, 6):
        for report in (never, every):
            report.after_micro_step(torch.tensor(1.0))
            report.after_optimizer_step(step, [0.1])
    assert every.last_values["step"] == 5  # the same calls log when the period comes
    assert never.last_line is None and never.last_values == {}


@pytest.mark.parametrize("name", ["tiled_loss", "tiled_mlp"])
def test_tiled_passes_take_true_false_or_planned_and_need_a_compiled_engine(name):
    for value in (True, False, "planned"):
        assert getattr(Config.from_any(make(compile={name: value})).compile, name) == value
    for value in ("yes", 1, None):
        assert f"compile.{name} must be true, false or 'planned'" in err(make(compile={name: value}))
    assert "cannot derive" in err(make(compile={name: "auto"}))  # Trainer's word, not this key's
    for value in (True, "planned"):
        assert f"compile.{name} with compile.auto_compile false" in err(
            make(compile={name: value, "auto_compile": False}))


@pytest.mark.parametrize("value", [float("-inf"), float("nan"), "inf", "Infinity", 0, 2.5, True])
def test_steps_per_print_refuses_other_values(value):
    assert "steps_per_print must be a positive integer or Infinity (never)" in err(make(steps_per_print=value))


@pytest.mark.parametrize(
    "d, expected",
    [
        ({}, "zero_optimization.stage is required (1, 2 or 3)"),
        ({"zero_optimization": {}}, "zero_optimization.stage is required (1, 2 or 3)"),
        ({"zero_optimization": {"stage": None}}, "zero_optimization.stage is required (1, 2 or 3)"),
        ({"zero_optimization": {"stage": 0}}, "stage 0 is not supported"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 1, 2 or 3, got 4"),
        ({"zero_optimization": {"stage": True}}, "zero_optimization.stage must be 1, 2 or 3, got True (bool)"),
        ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage must be 1, 2 or 3, got '3' (str)"),
    ],
)
def test_stage(d, expected):
    assert expected in err(d)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_valid_stages(stage):
    assert Config.from_any({"zero_optimization": {"stage": stage}}).zero_optimization.stage == stage


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match=r"zero_optimization.stage is required \(1, 2 or 3\)"):
        Config()
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        ZeroConfig(stage=0)
    c = Config(zero_optimization=ZeroConfig(stage=1), compile={"prefetch": False})
    assert c.compile == CompileConfig(prefetch=False)


def test_fp16_enabled_is_refused_until_loss_scaling_lands(monkeypatch):
    from deepcompile.config import features

    monkeypatch.setattr(features, "FP16_LOSS_SCALING", False)
    msg = err(make(fp16={"enabled": True}))
    assert "fp16.enabled" in msg and "fp16 is not supported; use bf16" in msg
    assert Config.from_any(make(fp16={"enabled": False})).fp16.enabled is False
    monkeypatch.setattr(features, "FP16_LOSS_SCALING", True)
    assert Config.from_any(make(fp16={"enabled": True})).fp16.enabled is True


def test_fp16_section_has_deepspeeds_defaults():
    f = Config.from_any(make(fp16={"enabled": False})).fp16
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.consecutive_hysteresis,
            f.min_loss_scale, f.auto_cast) == (0.0, 16, 1000, 2, False, 1.0, False)
    assert f.dynamic_loss_scale
    f = Config.from_any(make(fp16={"enabled": False, "loss_scale": 128, "initial_scale_power": 8,
                                   "loss_scale_window": 10, "hysteresis": 1, "consecutive_hysteresis": True,
                                   "min_loss_scale": 0.5})).fp16
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.consecutive_hysteresis,
            f.min_loss_scale) == (128.0, 8, 10, 1, True, 0.5)
    assert not f.dynamic_loss_scale
    assert "fp16.min_loss_scale must be a number in (0.0" in err(make(fp16={"min_loss_scale": 0}))
    assert "fp16.loss_scale_window must be a positive integer" in err(make(fp16={"loss_scale_window": 0}))


def test_fp16_and_bf16_together_are_refused(monkeypatch):
    from deepcompile.config import features

    monkeypatch.setattr(features, "FP16_LOSS_SCALING", True)
    with pytest.raises(ConfigError) as e:
        Config.from_any(make(fp16={"enabled": True}, bf16={"enabled": True}))
    assert e.value.keys == ["fp16.enabled"] and "both true" in str(e.value)
    # "auto" for both: the model's dtype picks at most one.
    c = Config.from_any(make(fp16={"enabled": "auto"}, bf16={"enabled": "auto"}))
    r = c.resolve(2, _Model(dtype=torch.float16))
    assert (r.fp16.enabled, r.bf16.enabled) == (True, False)
    r = c.resolve(2, _Model(dtype=torch.bfloat16))
    assert (r.fp16.enabled, r.bf16.enabled) == (False, True)


def test_zero_param_offload_to_cpu_is_accepted_under_zero3_only():
    from deepcompile.config import OffloadParam

    z = Config.from_any({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "cpu", "pin_memory": True, "buffer_count": 5, "max_in_cpu": 10}}}).zero_optimization
    assert z.offload_param == OffloadParam(device="cpu", pin_memory=True)
    z = Config.from_any({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}).zero_optimization
    assert z.offload_param == OffloadParam(device="cpu", pin_memory=False)  # DeepSpeed's default
    msg = err({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "zero_optimization.offload_param.device" in msg and "NVMe parameter offload is not implemented" in msg
    msg = err({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert "parameter offload applies to ZeRO-3's partitioned parameters" in msg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_optimizer_offload_to_cpu_is_accepted(stage):
    from deepcompile.config import OffloadOptimizer

    z = Config.from_any({"zero_optimization": {"stage": stage, "offload_optimizer": {
        "device": "cpu", "pin_memory": True, "ratio": 0.25, "buffer_count": 4, "fast_init": False}}}).zero_optimization
    assert z.offload_optimizer == OffloadOptimizer(device="cpu", pin_memory=True, ratio=0.25)
    z = Config.from_any({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}).zero_optimization
    assert z.offload_optimizer == OffloadOptimizer(device="cpu", pin_memory=False, ratio=1.0)  # DeepSpeed's defaults


@pytest.mark.parametrize("value,key,fragment", [
    ({"device": "nvme", "nvme_path": "/local_nvme"}, "device", "NVMe offload is not implemented"),
    ({"device": "gpu"}, "device", 'must be "none", "cpu" or "nvme"'),
    ({"device": "cpu", "ratio": 0}, "ratio", "must be a number in (0.0, 1.0]"),
    ({"device": "cpu", "ratio": 1.5}, "ratio", "must be a number in (0.0, 1.0]"),
    ({"device": "cpu", "pin_memory": 1}, "pin_memory", "true or false"),
    ({"device": "cpu", "buffer_count": 0}, "buffer_count", "positive integer"),
    ({"device": "cpu", "pipeline": True}, "pipeline", "unknown config key"),
])
def test_zero_optimizer_offload_bad_values(value, key, fragment):
    msg = err({"zero_optimization": {"stage": 3, "offload_optimizer": value}})
    assert f"zero_optimization.offload_optimizer.{key}" in msg and fragment in msg, msg


@pytest.mark.parametrize("value", [None, {}, {"device": "none"}, {"device": "none", "pin_memory": True}])
def test_zero_offload_off_is_accepted(value):
    c = Config.from_any({"zero_optimization": {"stage": 3, "offload_param": value, "offload_optimizer": value}})
    assert c == Config.from_any(Z3)


def test_zero_offload_must_be_an_object():
    assert "zero_optimization.offload_param must be an object or null" in err(
        {"zero_optimization": {"stage": 3, "offload_param": "cpu"}})


def test_offload_opt_states_is_a_switch():
    assert Config.from_any(make(compile={"offload_opt_states": True})).compile.offload_opt_states is True
    assert "true or false" in err(make(compile={"offload_opt_states": 1}))


def test_offload_parameters_is_a_zero3_switch():
    assert Config.from_any(make(compile={"offload_parameters": True})).compile.offload_parameters is True
    assert "true or false" in err(make(compile={"offload_parameters": 1}))
    cfg = make(compile={"offload_parameters": True})
    cfg["zero_optimization"] = {"stage": 1}
    assert "compile.offload_parameters: parameter offload applies to ZeRO-3's" in err(cfg)


def test_activation_keys_are_switches():
    c = Config.from_any(make(compile={"offload_activation": True, "free_activation": True,
                                      "offload_activation_pin_memory": False})).compile
    assert c.offload_activation is True and c.free_activation is True and c.offload_activation_pin_memory is False
    assert "true or false" in err(make(compile={"offload_activation": 1}))


@pytest.mark.parametrize("key", ["symmetric_memory"])
def test_unsupported_compile_features(key):
    msg = err(make(compile={key: True}))
    assert f"compile.{key}" in msg and "not supported yet" in msg
    assert "true or false" in err(make(compile={key: 1}))
    assert getattr(Config.from_any(make(compile={key: False})).compile, key) is False


# ------------------------------------------------------------------------------------ batch size


def test_check_batch_size():
    Config.from_any(make()).check_batch_size(8)  # nothing given: nothing to check
    c = Config.from_any(make(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2))
    c.check_batch_size(4)
    with pytest.raises(ValueError, match=r"train_batch_size \(32\) must equal .* = 16"):
        c.check_batch_size(2)
    only_micro = Config.from_any(make(train_micro_batch_size_per_gpu=4))
    only_micro.check_batch_size(3)
    only_total = Config.from_any(make(train_batch_size=12, gradient_accumulation_steps=2))
    only_total.check_batch_size(3)
    only_total.check_batch_size(6)
    with pytest.raises(ValueError, match="must be divisible by"):
        only_total.check_batch_size(4)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="world_size must be a positive integer"):
            c.check_batch_size(bad)


# ------------------------------------------------------------------------------------ runtime


def test_runtime_config_mapping():
    runtime = pytest.importorskip("deepcompile.runtime")
    c = Config.from_any(FULL)
    kwargs = c.runtime_config()
    assert kwargs == {
        "reduce_bucket_size": 500_000_000,
        "double_buffer": False,
        "free_activation_threshold": 1024,
        "sync_before_reduce": True,
        "sync_after_reduce": False,
        "sync_before_allgather": True,
        "sync_after_allgather": False,
    }
    rc = runtime.RuntimeConfig(**kwargs)
    assert rc.reduce_bucket_size == 500_000_000 and rc.free_activation_threshold == 1024

    # exactly RuntimeConfig's fields (the config does not import the runtime to check it itself)
    assert set(kwargs) == {f.name for f in dataclasses.fields(runtime.RuntimeConfig)}
    # defaults agree with RuntimeConfig's own defaults
    assert runtime.RuntimeConfig(**Config.from_any(Z3).runtime_config()) == runtime.RuntimeConfig()

    small = Config.from_any({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}})
    assert small.runtime_config()["reduce_bucket_size"] == 1000


# ------------------------------------------------------------------------------------ DeepSpeed keys
# (issue 16, part 5: configs as Hugging Face Trainer, accelerate and DeepSpeed users write them)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


class _Model(nn.Module):
    """A model with an HF-style config (hidden_size drives the "auto" bucket sizes)."""

    def __init__(self, hidden=16, dtype=torch.float32, with_config=True):
        super().__init__()
        if with_config:
            self.config = type("Cfg", (), {"hidden_size": hidden})()
        self.a = nn.Linear(hidden, 2 * hidden, dtype=dtype)
        self.b = nn.Linear(2 * hidden, 3, dtype=dtype)


def keys_of(d, world=2, model=None):
    """The dotted keys a config is refused for (parse and resolve), or [] when it is accepted."""
    try:
        Config.from_any(d).resolve(world, model)
    except ConfigError as e:
        return sorted(e.keys)
    return []


def test_all_problems_are_reported_at_once():
    d = {
        "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "offload_param": {"device": "nvme"},
                              "stgae": 1},
        "fp16": {"enabled": False, "auto_cast": True},
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "gradient_clipping": "auto",
        "tensorboard": {"enabled": True},
        "foo": 1,
    }
    with pytest.raises(ConfigError) as e:
        Config.from_any(d)
    assert sorted(e.value.keys) == sorted([
        "foo", "zero_optimization.stgae", "zero_optimization.zero_quantized_weights",
        "zero_optimization.offload_param.device",
        "fp16.auto_cast", "optimizer.type", "gradient_clipping", "tensorboard.enabled"])
    msg = str(e.value)
    assert msg.startswith("8 problems in the config:")
    assert "TrainingArguments.max_grad_norm" in msg  # why gradient_clipping "auto" cannot be derived
    assert isinstance(e.value, ValueError)


def test_deepspeed_aliases():
    c = Config.from_any({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
                         "bfloat16": {"enabled": True}})
    assert c.bf16.enabled is True
    assert c.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    # Both spellings with one value: accepted; a ZeRO key's two with two values: an error naming
    # both (bf16 and bfloat16 with two values: bf16 is read, tests/clients/).
    assert Config.from_any({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                            "bfloat16": {"enabled": True}}).bf16.enabled is True
    msg = err({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                     "stage3_gather_fp16_weights_on_model_save": False}})
    assert ("zero_optimization.stage3_gather_fp16_weights_on_model_save and "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save name the same setting") in msg


# Keys without effect by design: accepted with the value that describes the runtime, refused with
# any other value, with the reason. (section, key, accepted value, refused value, words of the reason)
ONLY_VALUE = [
    ("zero_optimization", "zero_quantized_weights", False, True, "ZeRO++"),
    ("zero_optimization", "zero_quantized_nontrainable_weights", False, True, "ZeRO++"),
    ("zero_optimization", "zero_quantized_gradients", False, True, "ZeRO++"),
    ("fp16", "auto_cast", False, True, "auto-casting"),
    ("compile", "deepcompile", True, False, "do not call engine.compile()"),
    ("compile", "keep_int_input_tensors", True, False, "real inputs"),
    ("compile", "keep_all_input_tensors", False, True, "real inputs"),
    ("zero_optimization", "contiguous_gradients", True, False, "contiguous reduce buckets"),
    ("zero_optimization", "reduce_scatter", True, False, "never all-reduced"),
    ("zero_optimization", "allgather_partitions", True, False, "all-gathered"),
    ("zero_optimization", "round_robin_gradients", False, True, "offload_optimizer"),
    ("zero_optimization", "memory_efficient_linear", False, True, "not implemented"),
    ("zero_optimization", "cpu_offload", False, True, "not supported"),
    ("bf16", "bf16_master_weights_and_grads", False, True, "always fp32"),
    ("fp16", "fp16_master_weights_and_grads", False, True, "always fp32"),
    ("activation_checkpointing", "partition_activations", False, True, "torch.utils.checkpoint"),
    ("activation_checkpointing", "cpu_checkpointing", False, True, "torch.utils.checkpoint"),
    ("activation_checkpointing", "contiguous_memory_optimization", False, True, "torch.utils.checkpoint"),
    ("activation_checkpointing", "synchronize_checkpoint_boundary", False, True, "torch.utils.checkpoint"),
    ("activation_checkpointing", "profile", False, True, "torch.utils.checkpoint"),
    ("tensorboard", "enabled", False, True, "monitoring backends are not implemented"),
    ("csv_monitor", "enabled", False, True, "monitoring backends are not implemented"),
    ("wandb", "enabled", False, True, "monitoring backends are not implemented"),
    ("hybrid_engine", "enabled", False, True, "hybrid"),
    (None, "prescale_gradients", False, True, "averages gradients inside the collective"),
    (None, "gradient_predivide_factor", 1.0, 2.0, "averages gradients inside the collective"),
]


@pytest.mark.parametrize("section,key,ok,bad,why", ONLY_VALUE, ids=lambda v: v if isinstance(v, str) else None)
def test_keys_without_effect_accept_only_the_runtime_value(section, key, ok, bad, why):
    def cfg(value):
        if section is None:
            return make(**{key: value})
        if section == "zero_optimization":
            return {"zero_optimization": {"stage": 3, key: value}}
        return make(**{section: {key: value}})

    Config.from_any(cfg(ok))
    msg = err(cfg(bad))
    dotted = f"{section}.{key}" if section else key
    assert dotted in msg and why in msg, msg


def test_inert_keys_accept_any_valid_value():
    Config.from_any({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
                     "zero_force_ds_cpu_optimizer": False, "activation_checkpointing": {"number_checkpoints": 4},
                     "fp16": {"enabled": False, "auto_cast": False, "loss_scale": 128, "hysteresis": 2,
                              "consecutive_hysteresis": True, "min_loss_scale": 1, "loss_scale_window": 100},
                     "hybrid_engine": {"enabled": False, "max_out_tokens": 256, "inference_tp_size": 1},
                     "wandb": {"enabled": False, "project": "p", "team": None}})


@pytest.mark.parametrize("key,value", [("stage3_param_persistence_threshold", 0), ("stage3_prefetch_bucket_size", 7),
                                       ("stage3_max_live_parameters", 10), ("sub_group_size", 1),
                                       ("stage3_max_reuse_distance", 0)])
@pytest.mark.parametrize("stage", [1, 2])
def test_stage3_keys_are_inert_under_stage_1_and_2(stage, key, value):
    # One config serves every stage by changing "stage" alone (as in DeepSpeed): the keys of
    # another stage are validated.
    Config.from_any({"zero_optimization": {"stage": stage, key: value}}).resolve(2, _Model())
    assert f"zero_optimization.{key}" in err({"zero_optimization": {"stage": stage, key: -1}})
    if key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        c = Config.from_any({"zero_optimization": {"stage": stage, key: "auto"}}).resolve(2, _Model())
        assert getattr(c.zero_optimization, key) == getattr(ZeroConfig(stage=stage), key)


def test_allgather_bucket_size_is_inert_under_stage_3():
    Config.from_any({"zero_optimization": {"stage": 3, "allgather_bucket_size": 2e8}})
    assert "allgather_bucket_size must be a positive integer" in err(
        {"zero_optimization": {"stage": 3, "allgather_bucket_size": 0}})


# ---- "auto"


def test_auto_bucket_sizes_follow_the_hidden_size():
    d = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                               "stage3_param_persistence_threshold": "auto"}}
    c = Config.from_any(d)
    assert c.zero_optimization.reduce_bucket_size == "auto"
    with pytest.raises(ValueError, match="still \"auto\""):
        c.runtime_config()
    z = c.resolve(2, _Model(hidden=24)).zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        24 * 24, int(0.9 * 24 * 24), 240)
    # no hidden size known: the defaults
    z = c.resolve(2, _Model(with_config=False)).zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)
    # hidden_sizes (several stages, e.g. convolutional models): the largest
    m = _Model(with_config=False)
    m.config = type("Cfg", (), {"hidden_sizes": [8, 32, 16]})()
    assert c.resolve(2, m).zero_optimization.reduce_bucket_size == 32 * 32


@pytest.mark.parametrize("name,floor,default", [("reduce_bucket_size", lambda h: h * h, 500_000_000),
                                                  ("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h),
                                                   50_000_000)])
def test_auto_bucket_is_one_repeated_block(name, floor, default):
    """reduce_bucket_size and stage3_prefetch_bucket_size "auto": the largest block of the classes
    _no_split_modules names, at least Trainer's value, at most the default (config/auto.py says
    why)."""
    c = Config.from_any({"zero_optimization": {"stage": 3, name: "auto"}})

    class Block(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(n), requires_grad=False)

    def model(block, hidden, names=("Block",)):
        m = torch.nn.Sequential(Block(block), Block(block // 2), torch.nn.Linear(2, 2))
        m._no_split_modules = list(names)
        m.config = type("Cfg", (), {"hidden_size": hidden})()
        return m

    def resolved(m, config=c):
        return getattr(config.resolve(2, m).zero_optimization, name)

    assert resolved(model(5000, 24)) == 5000
    assert resolved(model(100, 24)) == floor(24)  # Trainer's value is the floor
    assert resolved(model(5000, 24, names=())) == floor(24)
    assert resolved(model(5000, 24, names=("Other",))) == floor(24)
    big = model(10, 24)
    big.config.hidden_size = 10**5  # far above the default
    assert resolved(big) == default
    if name == "stage3_prefetch_bucket_size":  # inert under ZeRO-1/2: the default, whatever the model
        z2 = Config.from_any({"zero_optimization": {"stage": 2, name: "auto"}})
        assert resolved(model(5000, 24), z2) == default


@pytest.mark.parametrize("name,fill", [("reduce_bucket_size", lambda h: h * h),
                                       ("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h))])
def test_served_initialize_hands_trainer_filled_sizes_back_to_auto(name, fill):
    from types import SimpleNamespace

    from deepcompile.integrations.deepspeed_api import filled_sizes

    m = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    given = {"zero_optimization": {"stage": 3, name: fill(64), "stage3_param_persistence_threshold": 640}}
    out, keys = filled_sizes.unfill(given, m)
    assert keys == [f"zero_optimization.{name}"] and out["zero_optimization"][name] == "auto"
    assert given["zero_optimization"][name] == fill(64)  # the caller's dict is untouched
    assert out["zero_optimization"]["stage3_param_persistence_threshold"] == 640  # same "auto" either way
    for value in (fill(64) - 1, 5e8, "auto", True):  # anything but Trainer's fill is the user's and kept
        same, keys = filled_sizes.unfill({"zero_optimization": {name: value}}, m)
        assert keys == [] and same["zero_optimization"][name] == value
    assert filled_sizes.unfill(given, SimpleNamespace())[1] == []  # no hidden size: nothing to recognise
    both = {"zero_optimization": {"reduce_bucket_size": 64 * 64, "stage3_prefetch_bucket_size": int(0.9 * 64 * 64)}}
    assert len(filled_sizes.unfill(both, m)[1]) == 2


def test_auto_precision_follows_the_model_dtype(monkeypatch):
    from deepcompile.config import features

    monkeypatch.setattr(features, "FP16_LOSS_SCALING", False)
    d = make(bf16={"enabled": "auto"}, fp16={"enabled": "auto"})
    assert Config.from_any(d).resolve(2, _Model(dtype=torch.bfloat16)).bf16.enabled is True
    c = Config.from_any(d).resolve(2, _Model())
    assert c.bf16.enabled is False and c.fp16.enabled is False
    assert keys_of(d, model=_Model(dtype=torch.float16)) == ["fp16.enabled"]
    assert keys_of(d, model=None) == ["bf16.enabled", "fp16.enabled"]


@pytest.mark.parametrize(
    "given, world, expected",
    [
        # one "auto" of the three: derived from the other two (an absent gas counts as 1)
        (dict(train_batch_size="auto", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2, (16, 4, 2)),
        (dict(train_batch_size="auto", train_micro_batch_size_per_gpu=4), 3, (12, 4, 1)),
        (dict(train_batch_size=24, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=3), 2,
         (24, 4, 3)),
        (dict(train_batch_size=24, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps="auto"), 2,
         (24, 4, 3)),
        # DeepSpeed's completion without "auto"
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, (32, 4, 4)),
        (dict(train_batch_size=32), 4, (32, 8, 1)),
        (dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=5), 2, (20, 2, 5)),
        (dict(gradient_accumulation_steps=5), 2, (None, None, 5)),
        ({}, 2, (None, None, 1)),
    ],
)
def test_batch_sizes_are_completed(given, world, expected):
    c = Config.from_any(make(**given)).resolve(world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected
    assert c.resolve(world) == c  # idempotent


def test_batch_sizes_that_cannot_be_derived():
    two = make(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=1)
    with pytest.raises(ConfigError) as e:
        Config.from_any(two).resolve(2)
    assert sorted(e.value.keys) == ["train_batch_size", "train_micro_batch_size_per_gpu"]
    assert "per_device_train_batch_size" in str(e.value)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu is not given"):
        Config.from_any(make(train_batch_size="auto")).resolve(2)
    with pytest.raises(ConfigError, match=r"must be divisible by train_micro_batch_size_per_gpu \(4\) \* world size"):
        Config.from_any(make(train_batch_size=20, train_micro_batch_size_per_gpu=4)).resolve(2)
    with pytest.raises(ConfigError, match="train_batch_size"):
        Config.from_any(make(train_batch_size=20, train_micro_batch_size_per_gpu="auto",
                             gradient_accumulation_steps=3)).resolve(2)


@pytest.mark.parametrize(
    "d, key, words",
    [
        (make(gradient_clipping="auto"), "gradient_clipping", "max_grad_norm"),
        (make(optimizer={"type": "AdamW", "params": {"lr": "auto"}}), "optimizer.params.lr", "learning_rate"),
        (make(optimizer={"type": "AdamW", "params": {"lr": 1, "betas": "auto"}}), "optimizer.params.betas",
         "adam_beta1"),
        (make(optimizer={"type": "Adam", "params": {"eps": "auto"}}), "optimizer.params.eps", "adam_epsilon"),
        (make(optimizer={"type": "SGD", "params": {"weight_decay": "auto"}}), "optimizer.params.weight_decay",
         "weight_decay"),
        (make(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}),
         "scheduler.params.warmup_num_steps", "warmup_ratio"),
        (make(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}),
         "scheduler.params.total_num_steps", "training length"),
        (make(steps_per_print="auto"), "steps_per_print", "cannot derive"),
        (make(compile={"prefetch": "auto"}), "compile.prefetch", "cannot derive"),
    ],
)
def test_auto_that_cannot_be_derived_names_the_key(d, key, words):
    with pytest.raises(ConfigError) as e:
        Config.from_any(d)
    assert e.value.keys == [key]
    assert f'{key} is "auto"' in str(e.value) and words in str(e.value)


def test_scheduler_auto_learning_rates():
    c = Config.from_any(make(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                                        "warmup_max_lr": "auto"}}))
    p = c.scheduler.params_dict()
    assert p["warmup_min_lr"] == 0.0  # the constant HF fills
    assert p["warmup_max_lr"] == "auto"  # the optimizer's learning rate, taken when the schedule is built


# ---- limits the schedule planner keeps to


def test_limits_that_bind_are_accepted():
    # stage3_max_live_parameters / stage3_max_reuse_distance below the model's parameter count
    # bind, and the planner honours them (tests/scheduling/test_scheduling.py checks the plans).
    model = _Model(hidden=16)  # 16*32+32 + 32*3+3 = 643 parameters
    n = sum(p.numel() for p in model.parameters())
    z = lambda **kw: {"zero_optimization": {"stage": 3, **kw}}  # noqa: E731
    for live, reuse in ((n, 1e9), (n - 1, 10)):
        # sub_group_size binds and is implemented (zero/sub_groups.py) as well.
        assert keys_of(z(stage3_max_live_parameters=live, stage3_max_reuse_distance=reuse, sub_group_size=100),
                       model=model) == []
    c = Config.from_any(z(stage3_max_live_parameters=n - 1, stage3_max_reuse_distance=10)).resolve(2, model)
    assert (c.zero_optimization.stage3_max_live_parameters, c.zero_optimization.stage3_max_reuse_distance) == (n - 1, 10)


# ---- communication_data_type


@pytest.mark.parametrize(
    "stage, dtype, bf16, comm, gas, refused",
    [
        (3, torch.float32, False, "fp32", 1, False),
        (3, torch.float32, False, "bf16", 1, False),
        (3, torch.bfloat16, True, "bf16", 1, False),
        (3, torch.float32, True, "bf16", 2, True),   # would accumulate micro-steps in bf16 partitions
        (2, torch.float32, True, "bf16", 1, False),  # bf16.enabled: parameters (and so reductions) are bf16
        (2, torch.float32, False, "fp32", 1, False),
        (1, torch.bfloat16, False, "bf16", 2, False),
        (2, torch.float32, True, "fp32", 1, True),   # ZeRO-1/2 reduce in the parameters' dtype
        (1, torch.float32, False, "bf16", 1, True),
    ],
)
def test_communication_data_type(stage, dtype, bf16, comm, gas, refused):
    d = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "communication_data_type": comm,
         "gradient_accumulation_steps": gas}
    keys = keys_of(d, model=_Model(dtype=dtype))
    assert keys == (["communication_data_type"] if refused else []), keys


def test_fp16_communication_is_refused():
    assert "communication_data_type=\"fp16\" is not supported" in err(make(communication_data_type="fp16"))


# ---- optimizer and scheduler sections


def test_optimizer_section():
    c = Config.from_any(make(optimizer={"type": "adam", "params": {"lr": 3e-4, "adam_w_mode": False}}))
    assert c.optimizer.type == "Adam"  # DeepSpeed matches its optimizer names case-insensitively
    assert c.optimizer.params_dict() == {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                         "adam_w_mode": False, "bias_correction": True, "amsgrad": False,
                                         "torch_adam": False}
    sgd = Config.from_any(make(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}))
    assert sgd.optimizer.params_dict()["nesterov"] is True


@pytest.mark.parametrize(
    "section, key, words",
    [
        ({"type": "Lamb"}, "optimizer.type", "deepcompile builds Adam, AdamW, SGD"),
        ({"params": {"lr": 1}}, "optimizer.type", "required"),
        ({"type": "AdamW", "params": {"lr": -1}}, "optimizer.params.lr", "must be a number >= 0.0"),
        ({"type": "AdamW", "params": {"betas": [0.9]}}, "optimizer.params.betas", "list of two numbers"),
        ({"type": "AdamW", "params": {"momentum": 0.9}}, "optimizer.params.momentum", "supported: lr, betas"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "optimizer.params.max_grad_norm", "gradient_clipping"),
        ({"type": "AdamW", "params": {"adam_w_mode": False}}, "optimizer.params.adam_w_mode", "contradicts"),
        ({"type": "Adam", "params": {"bias_correction": False}}, "optimizer.params.bias_correction", "bias"),
        ({"type": "AdamW", "legacy_fusion": True}, "optimizer.legacy_fusion", "fp16"),
        ({"type": "AdamW", "params": [1]}, "optimizer.params", "must be an object"),
    ],
)
def test_bad_optimizer_sections(section, key, words):
    with pytest.raises(ConfigError) as e:
        Config.from_any(make(optimizer=section))
    assert e.value.keys == [key] and words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "section, key, words",
    [
        ({"type": "OneCycle", "params": {}}, "scheduler.type", "WarmupLR, WarmupDecayLR, WarmupCosineLR"),
        ({"type": "warmuplr"}, "scheduler.type", "did you mean 'WarmupLR'"),
        ({"type": "WarmupDecayLR", "params": {}}, "scheduler.params.total_num_steps", "required"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "scheduler.params.warmup_type", "'log', 'linear'"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, "scheduler.params.warmup_num_steps",
         "non-negative"),
        ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}}, "scheduler.params.last_batch_iteration",
         "first step"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_min_ratio": -0.5}},
         "scheduler.params.warmup_min_ratio", ">= 0.0"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_max_lr": 1}},
         "scheduler.params.warmup_max_lr", "unknown config key"),
    ],
)
def test_bad_scheduler_sections(section, key, words):
    with pytest.raises(ConfigError) as e:
        Config.from_any(make(scheduler=section))
    assert e.value.keys == [key] and words in str(e.value), str(e.value)


# ---- the key table in docs/config.md lists every key the code accepts


def _documented_keys():
    text = (ROOT / "docs" / "config.md").read_text()
    text = text.split("## The table", 1)[1]
    keys = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            keys.add(line.split("`")[1])
    return keys


def _code_keys():
    from deepcompile.config.root import _SECTIONS as config_sections  # every section the top level reads

    keys = set()

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            name = prefix + f.name
            sub = config_sections.get(name) if not prefix else None
            if sub is not None:
                walk(sub, name + ".")
            else:
                keys.add(name)

    walk(Config, "")
    from deepcompile.config import OPTIMIZER_TYPES, SCHEDULER_TYPES

    for spec in (*OPTIMIZER_TYPES.values(), *SCHEDULER_TYPES.values()):
        keys |= {"optimizer.params." + k if spec in OPTIMIZER_TYPES.values() else "scheduler.params." + k
                 for k in spec}
    keys -= {"optimizer.params", "scheduler.params"}
    return keys | {"optimizer", "scheduler"}  # the two sections have rows of their own


def test_docs_table_lists_every_key():
    documented, code = _documented_keys(), _code_keys()
    assert not code - documented, f"keys missing from docs/config.md: {sorted(code - documented)}"
    assert not documented - code, f"docs/config.md lists keys the code does not have: {sorted(documented - code)}"
