"""``deepcompile.config``: parsing, defaults, strict validation and error messages of the user
config (DeepSpeed's JSON keys), and its mapping onto the runtime settings. Pure Python, one process.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from deepcompile.config import Bf16Config, CompileConfig, Config, Fp16Config, ZeroConfig

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
    assert c.gradient_accumulation_steps == 1
    assert c.gradient_clipping == 0.0
    assert c.steps_per_print == 10
    assert c.wall_clock_breakdown is False
    assert c.bf16 == Bf16Config(enabled=False)
    assert c.fp16 == Fp16Config(enabled=False)

    z = c.zero_optimization
    assert z.stage == 3
    assert z.reduce_bucket_size == 500_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.offload_param is None and z.offload_optimizer is None

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
    for cls in (Config, ZeroConfig, CompileConfig, Bf16Config, Fp16Config):
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
    "bf16": {"enabled": True},
    "fp16": {"enabled": False},
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 0,
        "contiguous_gradients": False,
        "overlap_comm": True,
        "allgather_bucket_size": 2e8,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_live_parameters": 10,
        "stage3_max_reuse_distance": 0,
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
        "keep_int_input_tensors": False,
        "keep_all_input_tensors": True,
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
    assert type(c.zero_optimization.allgather_bucket_size) is int
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
    msg = err(make(optimizer={"type": "Adam"}))
    assert "'optimizer'" in msg
    for k in ("zero_optimization", "compile", "bf16", "train_batch_size", "gradient_clipping"):
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


def test_fp16_enabled_is_rejected():
    msg = err(make(fp16={"enabled": True}))
    assert "fp16.enabled" in msg and "fp16 is not supported; use bf16" in msg
    assert Config.from_any(make(fp16={"enabled": False})).fp16.enabled is False


@pytest.mark.parametrize("which", ["offload_param", "offload_optimizer"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_zero_offload_is_rejected(which, device):
    msg = err({"zero_optimization": {"stage": 3, which: {"device": device}}})
    assert f"zero_optimization.{which}.device" in msg and "offload is not supported yet" in msg


@pytest.mark.parametrize("value", [None, {}, {"device": "none"}, {"device": "none", "pin_memory": True}])
def test_zero_offload_off_is_accepted(value):
    c = Config.from_any({"zero_optimization": {"stage": 3, "offload_param": value, "offload_optimizer": value}})
    assert c == Config.from_any(Z3)


def test_zero_offload_must_be_an_object():
    assert "zero_optimization.offload_param must be an object or null" in err(
        {"zero_optimization": {"stage": 3, "offload_param": "cpu"}})


@pytest.mark.parametrize("key", ["offload_activation", "offload_opt_states", "offload_parameters", "symmetric_memory"])
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

    # defaults agree with RuntimeConfig's own defaults
    assert runtime.RuntimeConfig(**Config.from_any(Z3).runtime_config()) == runtime.RuntimeConfig()

    small = Config.from_any({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}})
    assert small.runtime_config()["reduce_bucket_size"] == 1000
