"""The precision of a model built inside the served ``deepspeed.zero.Init`` (issue 50, item 3).

DeepSpeed's ``Init`` builds in one dtype: its ``dtype=`` argument, else the config's ``bf16`` /
``fp16`` (``"auto"`` reads as false), else float32 with a config. transformers relies on it: under
``HfDeepSpeedConfig`` with bf16 (or fp16) enabled, ``from_config``/``from_pretrained`` hand out bf16
(fp16) parameters (transformers' tests ``test_init_zero3_fp16`` and ``test_arange_bf16``). The
served ``Init`` once left every model in float32.

``serve_as_deepspeed()`` rewrites ``sys.modules`` for the life of a process, so the probes run in
one served child process (one gloo rank, no GPU), each caught on its own; each test reads its
probe's outcome.
"""

from __future__ import annotations


import pytest

from _harness import hf_launch, served_probes

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}

# ---- probes: run in the served child process ------------------------------------------------


def _tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def _from_config(ds_config, **kwargs):
    """``from_config`` of the tiny Llama under ``HfDeepSpeedConfig(ds_config)`` (ZeRO-3, so inside
    the served ``zero.Init``); the HfDeepSpeedConfig is dropped afterwards."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled, \
        unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds_config)  # transformers holds it by a weak reference
    try:
        assert is_deepspeed_zero3_enabled()
        return AutoModelForCausalLM.from_config(_tiny_llama(), **kwargs)
    finally:
        del keep
        unset_hf_deepspeed_config()


def _param_dtypes(model):
    return {str(p.dtype) for p in model.parameters()}


def _check_built_in(model, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    from deepcompile.integrations.deepspeed_api.zero_init import preset_of

    assert _param_dtypes(model) == {str(dtype)}, _param_dtypes(model)
    for name, p in model.named_parameters():
        assert preset_of(p) is not None and preset_of(p).dtype == dtype, name  # deferred, in that dtype
    # The rotary buffers are transformers' own, in fp32: computed from integer aranges (and
    # transformers exempts torch.arange around zero.Init), bitwise those of a plain build.
    plain = dict(AutoModelForCausalLM.from_config(_tiny_llama()).named_buffers())
    for name, b in model.named_buffers():
        assert b.dtype == plain[name].dtype == torch.float32, (name, b.dtype)
        assert torch.equal(b, plain[name]), name


def _probe_from_config_bf16():
    import torch

    model = _from_config({**ZERO3, "bf16": {"enabled": True}})
    _check_built_in(model, torch.bfloat16)
    # The values are usable: gathered, they are the bf16 weights transformers initialised.
    import deepspeed

    with deepspeed.zero.GatheredParameters([model.lm_head.weight]):
        w = model.lm_head.weight
        assert w.dtype == torch.bfloat16 and torch.isfinite(w).all() and w.abs().sum() > 0


def _probe_from_config_fp16():
    import torch

    _check_built_in(_from_config({**ZERO3, "fp16": {"enabled": True}}), torch.float16)
    # DeepSpeed's older spelling of the section
    _check_built_in(_from_config({**ZERO3, "bfloat16": {"enabled": True}}), torch.bfloat16)


def _probe_config_without_half_builds_fp32():
    import torch

    # "auto" (HfDeepSpeedConfig without Trainer leaves it) reads as false, as DeepSpeed's parser
    # drops "auto" values; the config then decides even over from_config(dtype=...).
    _check_built_in(_from_config({**ZERO3, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}),
                    torch.float32)
    _check_built_in(_from_config({**ZERO3, "bf16": {"enabled": False}}, dtype=torch.bfloat16), torch.float32)


def _probe_init_dtype_argument():
    import torch
    import torch.nn as nn

    import deepspeed

    with deepspeed.zero.Init(dtype=torch.bfloat16):
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    assert _param_dtypes(model) == {"torch.bfloat16"}, _param_dtypes(model)
    # dtype= wins over the config, as in DeepSpeed
    init = deepspeed.zero.Init(config_dict_or_path={**ZERO3, "fp16": {"enabled": True}}, dtype=torch.float32)
    assert init.dtype == torch.float32
    with init:
        model = nn.Linear(4, 3)
    assert _param_dtypes(model) == {"torch.float32"}
    # the deprecated config= is read as config_dict_or_path
    assert deepspeed.zero.Init(config={**ZERO3, "bf16": {"enabled": True}}).dtype == torch.bfloat16
    for bad in (torch.float64, torch.int8):
        try:
            deepspeed.zero.Init(dtype=bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"Init(dtype={bad}) accepted")
    try:
        deepspeed.zero.Init(config_dict_or_path={**ZERO3, "bf16": {"enabled": True}, "fp16": {"enabled": True}})
    except RuntimeError:
        pass
    else:
        raise AssertionError("bf16 and fp16 both enabled accepted")


def _mixed_module():
    """A module whose constructor makes tensors in several ways."""
    import torch
    import torch.nn as nn

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.asked_fp32 = nn.Linear(3, 2, dtype=torch.float32)  # torch.empty(dtype=...): converted
            self.from_rand = nn.Parameter(torch.rand(5))  # torch.rand is no constructor Init wraps
            self.legacy = nn.Parameter(torch.Tensor(2, 2).zero_())
            self.register_buffer("zeros", torch.zeros(4))
            self.register_buffer("steps", torch.arange(4))  # integer: never converted
            self.register_buffer("positions", torch.arange(4, dtype=torch.float32))

    return Mixed()


# The constructors DeepSpeed's Init wraps (besides torch.Tensor(...)).
_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


def _probe_what_init_converts():
    import torch

    import deepspeed

    before = {name: getattr(torch, name) for name in _CONSTRUCTORS}
    with deepspeed.zero.Init(dtype=torch.bfloat16):
        m = _mixed_module()
        inside = torch.zeros(2, requires_grad=True)
        assert inside.dtype == torch.bfloat16 and inside.requires_grad and inside.is_leaf
    # As DeepSpeed: floating-point tensors from torch's constructors become the build dtype, even
    # where the caller asked for another; tensors made otherwise keep theirs (deferred as they are).
    assert m.asked_fp32.weight.dtype == m.asked_fp32.bias.dtype == torch.bfloat16
    assert m.legacy.dtype == torch.bfloat16
    assert m.from_rand.dtype == torch.float32
    assert m.zeros.dtype == torch.bfloat16 and m.positions.dtype == torch.bfloat16
    assert m.steps.dtype == torch.int64
    # Afterwards torch's constructors are torch's again.
    assert {name: getattr(torch, name) for name in _CONSTRUCTORS} == before
    assert "__new__" not in vars(torch.Tensor)
    assert torch.zeros(1).dtype == torch.float32 and torch.Tensor(1).dtype == torch.float32


def _probe_no_config_builds_fp32():
    import torch
    import torch.nn as nn

    import deepspeed

    with deepspeed.zero.Init():
        model = nn.Linear(4, 3, dtype=torch.bfloat16)
    assert _param_dtypes(model) == {"torch.float32"}, _param_dtypes(model)
    assert deepspeed.zero.Init().dtype == torch.float32


def _train_one_step(half):
    import torch

    import deepspeed

    ds_config = {**ZERO3, half: {"enabled": True}, "compile": {"backend": "eager"}}
    if half == "fp16":
        ds_config[half]["initial_scale_power"] = 4
    dtype = torch.bfloat16 if half == "bf16" else torch.float16
    torch.manual_seed(0)
    model = _from_config(ds_config)
    assert _param_dtypes(model) == {str(dtype)}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        built = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    try:
        # The engine starts from exactly the values built in the half type.
        start = engine.engine.full_state_dict(all_ranks=True)
        for name, want in built.items():
            assert torch.equal(start[name].cpu().to(dtype), want), name
        ids = torch.randint(0, 64, (1, 8))
        loss = engine(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss), loss
        engine.backward(loss)
        engine.step()
        assert engine.was_step_applied()
        after = engine.engine.full_state_dict(all_ranks=True)
        assert not torch.equal(after["lm_head.weight"].cpu().to(dtype), built["lm_head.weight"])
    finally:
        engine.destroy()


def _probe_trains_one_step_bf16():
    _train_one_step("bf16")


def _probe_trains_one_step_fp16():
    _train_one_step("fp16")


_PROBES = ["_probe_from_config_bf16", "_probe_from_config_fp16", "_probe_config_without_half_builds_fp32",
           "_probe_init_dtype_argument", "_probe_what_init_converts", "_probe_no_config_builds_fp32",
           "_probe_trains_one_step_bf16", "_probe_trains_one_step_fp16"]


# ---- two gloo ranks, the served package used directly (the pool's ranks are shared) -------------


def _two_ranks_body(ctx):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from deepcompile.integrations import deepspeed_api
    from deepcompile.integrations.deepspeed_api.zero import Init
    from deepcompile.integrations.deepspeed_api.zero_init import held_elements

    def build():
        return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))

    torch.manual_seed(200)
    reference = build().to(torch.bfloat16)  # rank 0's constructor values, rounded to bf16
    torch.manual_seed(200 + ctx.rank)  # any other rank's values would show
    config = {**ZERO3, "bf16": {"enabled": True}, "compile": {"backend": "eager"}}
    with Init(config_dict_or_path=config):
        model = build()
    assert _param_dtypes(model) == {"torch.bfloat16"}
    assert held_elements(model) == {n: -(-p.numel() // 2) for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed_api.initialize(model=model, optimizer=optimizer, config=config)
    try:
        got = engine.engine.full_state_dict(all_ranks=True)
        for name, want in reference.state_dict().items():
            assert torch.equal(got[name].cpu().to(torch.bfloat16), want), name
        loss = engine(torch.ones(2, 5, dtype=torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        assert engine.was_step_applied()
    finally:
        engine.destroy()
    dist.barrier()


@pytest.mark.world_size(2)
def test_bf16_slices_on_two_ranks_are_rank0_values_and_train():
    """Built inside Init under a bf16 config on two ranks seeded differently: each rank holds half
    of every bf16 parameter, and the engine starts from rank 0's values and takes a step."""
    from _harness.multiproc import require_world_size, run_distributed

    require_world_size(2)
    run_distributed(_two_ranks_body, world_size=2)


# ---- tests: in pytest's process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zero_init_dtype") / "outcomes.json")
    env = {"CUDA_VISIBLE_DEVICES": "", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(hf_launch._free_port())}
    return served_probes.run_in_served_child(__file__, "zero_init_dtype_probes", out, env, timeout=600)


def _check(outcomes, probe):
    served_probes.check(outcomes, probe)


def test_from_config_under_bf16_config_builds_bf16(outcomes):
    _check(outcomes, "_probe_from_config_bf16")


def test_from_config_under_fp16_config_builds_fp16(outcomes):
    _check(outcomes, "_probe_from_config_fp16")


def test_config_without_half_precision_builds_fp32(outcomes):
    _check(outcomes, "_probe_config_without_half_builds_fp32")


def test_init_dtype_argument_wins_and_is_checked(outcomes):
    _check(outcomes, "_probe_init_dtype_argument")


def test_init_converts_what_torch_constructors_make(outcomes):
    _check(outcomes, "_probe_what_init_converts")


def test_init_without_config_or_dtype_builds_fp32(outcomes):
    _check(outcomes, "_probe_no_config_builds_fp32")


@pytest.mark.world_size(1)  # the served child is one gloo rank
@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_model_built_in_half_trains_one_step(outcomes, half):
    _check(outcomes, f"_probe_trains_one_step_{half}")
