"""DeepSpeed configs as real projects publish them (issue 16, part 5; issue 29, item 3), and the
engine features their keys switch on.

The fixtures in ``fixtures/ds_configs/`` are the published configs of six projects, unchanged
(``SOURCES`` says where each comes from). For each one:

* as published: parsing reports exactly the keys deepcompile cannot derive (the ``"auto"`` values
  HF Trainer / accelerate fill from their arguments) and the keys it refuses;
* after filling those ``"auto"`` values the way HF Trainer does (``hf_fill``): it is either
  accepted, or refused for exactly the keys this runtime cannot honour (offload, fp16, ZeRO
  stage 0, ...), each named in one error;
* refused ones, with just those keys changed (``EDITS``), and accepted ones as they are: an engine
  initializes on 2 gloo ranks, derives the remaining ``"auto"`` values itself and trains a few
  steps with the optimizer and learning-rate schedule the config describes.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.nn as nn

from deepcompile.config import Config, ConfigError
from deepcompile.config.features import FP16_LOSS_SCALING
from _harness.multiproc import run_distributed
from _harness.paths import TESTS

WORLD = 2
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
FIXTURES = TESTS / "fixtures" / "ds_configs"

SOURCES = {
    "hf_transformers_docs_zero3": "https://github.com/huggingface/transformers/blob/main/docs/source/en/deepspeed.md "
                                  "(the ds_config_zero3.json written in the 'Notebook' section)",
    "hf_transformers_zero3_bf16": "https://github.com/huggingface/transformers/blob/main/tests/deepspeed/"
                                  "ds_config_zero3_bf16.json",
    "accelerate_zero_stage2": "https://github.com/huggingface/accelerate/blob/main/examples/"
                              "deepspeed_config_templates/zero_stage2_config.json",
    "accelerate_zero_stage3_offload": "https://github.com/huggingface/accelerate/blob/main/examples/"
                                      "deepspeed_config_templates/zero_stage3_offload_config.json",
    "dsexamples_cifar": "https://github.com/deepspeedai/DeepSpeedExamples/blob/master/training/cifar/ds_config.json",
    "dschat_train_zero3_bf16": "https://github.com/deepspeedai/DeepSpeedExamples/blob/master/applications/"
                               "DeepSpeed-Chat/dschat/utils/ds_utils.py: get_train_ds_config(offload=False, "
                               "dtype='bf16', stage=3) with its other arguments at their defaults",
    # The fine-tuning projects' ZeRO-3 configs (issue 29, item 3): DeepSpeed's unprefixed aliases,
    # limits at 0, sub_group_size 0, overlap_comm false, both offloads, fp16/bf16 "auto", and keys
    # DeepSpeed itself ignores (monitor_config, comms_config).
    "axolotl_zero3_bf16": "https://github.com/axolotl-ai-cloud/axolotl/blob/1aaebb0dc1229adf56a7c8e0eeed91c6094b7715/"
                          "deepspeed_configs/zero3_bf16.json",
    "axolotl_zero3_bf16_cpuoffload_all": "https://github.com/axolotl-ai-cloud/axolotl/blob/"
                                         "1377ccc3e46bdc1c8b01a9c23da57446b85aa1d5/deepspeed_configs/"
                                         "zero3_bf16_cpuoffload_all.json",
    "llamafactory_ds_z3": "https://github.com/hiyouga/LLaMA-Factory/blob/1d6e8b218240c154638f9bdcb76a1a089c27891b/"
                          "examples/deepspeed/ds_z3_config.json",
    "ms_swift_zero3": "https://github.com/modelscope/ms-swift/blob/35992c1cc9092af233edbd75a2aefcd496d6fc19/"
                      "swift/llm/ds_config/zero3.json",
    "ms_swift_zero3_offload": "https://github.com/modelscope/ms-swift/blob/401737e2bbd49e03a60cedb154847dbe01cc58c4/"
                              "swift/llm/ds_config/zero3_offload.json",
}


def load(name: str) -> Dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


# ---- HF Trainer's filling of "auto", for the values deepcompile cannot derive itself

HF_ARGS = {  # TrainingArguments-like values of the test run
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "learning_rate": 0.01,
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "adam_epsilon": 1e-6,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "warmup_steps": 2,
    "num_training_steps": 6,
}


def hf_fill(d: Dict[str, Any], args: Dict[str, Any] = HF_ARGS) -> Dict[str, Any]:
    """Replace the "auto" values HF Trainer fills from TrainingArguments and that deepcompile cannot
    derive (batch sizes per device, clipping, optimizer hyper-parameters, the schedule's length).
    The rest (train_batch_size, bf16/fp16, bucket sizes, warmup_min/max_lr) stays "auto"."""
    d = copy.deepcopy(d)

    def fill(path: str, value: Any) -> None:
        node = d
        *parents, last = path.split(".")
        for p in parents:
            node = node.get(p)
            if not isinstance(node, dict):
                return
        if node.get(last) == "auto":
            node[last] = value

    fill("train_micro_batch_size_per_gpu", args["per_device_train_batch_size"])
    fill("gradient_accumulation_steps", args["gradient_accumulation_steps"])
    fill("gradient_clipping", args["max_grad_norm"])
    fill("optimizer.params.lr", args["learning_rate"])
    fill("optimizer.params.betas", [args["adam_beta1"], args["adam_beta2"]])
    fill("optimizer.params.eps", args["adam_epsilon"])
    fill("optimizer.params.weight_decay", args["weight_decay"])
    fill("scheduler.params.warmup_num_steps", args["warmup_steps"])
    fill("scheduler.params.total_num_steps", args["num_training_steps"])
    return d


def _fp16_to_bf16(d):
    d["fp16"]["enabled"] = False
    d["bf16"] = {"enabled": True}


def _cifar_edit(d):
    d["zero_optimization"]["stage"] = 1
    for k in ("loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale", "initial_scale_power"):
        del d["bf16"][k]


# fp16.enabled: true is refused until deepcompile's loss scaler lands (config/features.py).
FP16 = [] if FP16_LOSS_SCALING else ["fp16.enabled"]
NOT_DERIVABLE_HF = ["gradient_clipping", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.lr",
                    "optimizer.params.weight_decay", "scheduler.params.warmup_num_steps"]
# offload_optimizer and (ZeRO-3) offload_param with device "cpu" are implemented (deepcompile/offload/):
# the HF ZeRO-3 configs train as published, with both offloads on.

# name: (keys refused as published, keys refused after hf_fill, the edit that makes it train, the model's dtype)
CASES: Dict[str, tuple] = {
    "hf_transformers_docs_zero3": (NOT_DERIVABLE_HF, [], None, torch.float32),
    "hf_transformers_zero3_bf16": (NOT_DERIVABLE_HF, [], None, torch.bfloat16),
    "accelerate_zero_stage2": (
        FP16 + ["gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
                "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"],
        FP16, _fp16_to_bf16, torch.float32),
    "accelerate_zero_stage3_offload": (
        FP16 + ["gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
                "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"],
        FP16, None, torch.float32),
    "dsexamples_cifar": (
        ["bf16.hysteresis", "bf16.initial_scale_power", "bf16.loss_scale", "bf16.loss_scale_window",
         "bf16.min_loss_scale", "zero_optimization.stage"],
        None, _cifar_edit, torch.float32),  # None: nothing to fill, refused as published
    "dschat_train_zero3_bf16": ([], [], None, torch.float32),
    "axolotl_zero3_bf16": (["gradient_clipping"], [], None, torch.float32),
    "axolotl_zero3_bf16_cpuoffload_all": (["gradient_clipping"], [], None, torch.float32),
    "llamafactory_ds_z3": (["gradient_clipping"], [], None, torch.bfloat16),  # bf16 "auto" follows the model
    "ms_swift_zero3": (["gradient_clipping"], [], None, torch.float32),
    "ms_swift_zero3_offload": (NOT_DERIVABLE_HF + ["scheduler.params.total_num_steps"], [], None, torch.float32),
}
# Checked up to initialize's resolution (below) but not trained on 2 ranks: what they switch on is
# trained by the other cases (CI time).
# accelerate's fp16 template trains in tests/precision/test_fp16_training.py's domain once fp16 is accepted.
RESOLVE_ONLY = {"axolotl_zero3_bf16", "ms_swift_zero3", "ms_swift_zero3_offload", "accelerate_zero_stage3_offload"}


def test_every_fixture_has_a_source_and_a_case():
    names = sorted(p.stem for p in FIXTURES.glob("*.json"))
    assert names == sorted(SOURCES) == sorted(CASES)
    projects = {SOURCES[n].split("/")[4] for n in names}
    assert projects == {"transformers", "accelerate", "DeepSpeedExamples", "axolotl", "LLaMA-Factory", "ms-swift"}


class HFTiny(nn.Module):
    """A tiny model with an HF-style config: hidden_size 8 drives the "auto" bucket sizes."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": 8})()
        self.up = nn.Linear(8, 16, dtype=dtype)
        self.down = nn.Linear(16, 8, dtype=dtype)

    def forward(self, x):
        h = self.down(torch.nn.functional.gelu(self.up(x.to(self.up.weight.dtype))))
        return (h.float() - x.float()).pow(2).mean()


def refused_keys(d, dtype=torch.float32) -> List[str]:
    try:
        Config.from_any(d).resolve(WORLD, HFTiny(dtype))
    except ConfigError as e:
        assert len(set(e.keys)) == len(e.keys), e.keys  # each key named once
        return sorted(e.keys)
    return []


@pytest.mark.parametrize("name", sorted(CASES))
def test_published_config_is_refused_for_exactly_the_unsupported_keys(name):
    as_published, after_fill, _, dtype = CASES[name]
    assert refused_keys(load(name), dtype) == sorted(as_published)
    if after_fill is not None:
        assert refused_keys(hf_fill(load(name)), dtype) == sorted(after_fill)


def test_refusals_say_why():
    if FP16_LOSS_SCALING:  # both of its offloads (optimizer, ZeRO-3 parameters) and fp16 are accepted
        Config.from_any(hf_fill(load("accelerate_zero_stage3_offload")))
    else:
        with pytest.raises(ConfigError) as e:
            Config.from_any(hf_fill(load("accelerate_zero_stage3_offload")))
        msg = str(e.value)
        assert "fp16 is not supported; use bf16" in msg
        assert "offload" not in msg  # both of its offloads (optimizer, ZeRO-3 parameters) are accepted
    with pytest.raises(ConfigError) as e:
        Config.from_any(load("hf_transformers_docs_zero3"))
    assert "TrainingArguments.learning_rate" in str(e.value)


def trainable_config(name: str) -> Dict[str, Any]:
    as_published, after_fill, edit, _ = CASES[name]
    d = hf_fill(load(name)) if after_fill is not None else load(name)
    if edit is not None:
        edit(d)
    return d


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2] is not None or not c[1]))
def test_edited_config_is_accepted(name):
    assert refused_keys(trainable_config(name), CASES[name][3]) == []


# ---- training on 2 ranks

# The learning rates expected after each optimizer step (t = 1, 2, ...), from DeepSpeed's formulas.
LR = HF_ARGS["learning_rate"]
EXPECTED_LRS = {
    # WarmupLR, W = 2 (log), min 0 ("auto"), max = the optimizer's lr ("auto")
    "hf_transformers_docs_zero3": [0.0, LR, LR, LR],
    "hf_transformers_zero3_bf16": [0.0, LR, LR, LR],
    # WarmupDecayLR, W = 2 (log), T = 6: after the warm-up (6 - i) / 4 for i = t - 1
    "accelerate_zero_stage2": [0.0, LR, LR, LR * 3 / 4],
    # WarmupLR, W = 1000 (log), max 0.001
    "dsexamples_cifar": [0.0, 1e-3 * math.log(2) / math.log(1000), 1e-3 * math.log(3) / math.log(1000),
                         1e-3 * math.log(4) / math.log(1000)],
}
# Values deepcompile derives at initialize: (train_batch_size, micro, gas, reduce_bucket_size,
# stage3_prefetch_bucket_size, stage3_param_persistence_threshold, bf16)
DERIVED = {
    "hf_transformers_docs_zero3": (8, 2, 2, 64, 57, 80, False),
    "hf_transformers_zero3_bf16": (8, 2, 2, 64, 57, 80, True),
    "accelerate_zero_stage2": (4, 2, 1, 64, 50_000_000, 100_000, True),
    "dsexamples_cifar": (16, 8, 1, 50_000_000, 50_000_000, 100_000, True),
    "dschat_train_zero3_bf16": (32, 4, 4, 500_000_000, 30_000_000, 10_000, True),
    "accelerate_zero_stage3_offload": (4, 2, 1, 64, 57, 80, False),
    "axolotl_zero3_bf16": (8, 2, 2, 64, 57, 80, True),
    "axolotl_zero3_bf16_cpuoffload_all": (8, 2, 2, 64, 57, 80, True),
    "llamafactory_ds_z3": (8, 2, 2, 64, 57, 80, True),
    "ms_swift_zero3": (8, 2, 2, 64, 57, 80, False),
    "ms_swift_zero3_offload": (8, 2, 2, 64, 57, 80, False),
}


def _derived(c):
    z = c.zero_optimization
    return (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
            z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold, c.bf16.enabled)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2] is not None or not c[1]))
def test_config_resolves_at_world_size_2(name):
    # What initialize derives from the "auto" values, without starting any process.
    c = Config.from_any(trainable_config(name)).resolve(WORLD, HFTiny(CASES[name][3]))
    assert _derived(c) == DERIVED[name]
    assert c.resolve(WORLD, HFTiny(CASES[name][3])) == c  # idempotent


def test_fine_tuning_configs_mean_what_deepspeed_means():
    from deepcompile.config.rules import optional_passes
    from deepcompile.scheduling.schedule import PassSchedule

    model = HFTiny()
    axolotl = Config.from_any(trainable_config("axolotl_zero3_bf16_cpuoffload_all")).resolve(WORLD, model)
    z = axolotl.zero_optimization
    # Unprefixed aliases land on the stage3_ keys; 0 limits turn their pass off (DeepSpeed then
    # prefetches nothing and keeps no released parameter); sub_group_size 0 is one parameter per group.
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance, z.sub_group_size) == (0, 0, 1)
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert z.offload_param.pin_memory and z.offload_optimizer.pin_memory
    assert optional_passes(axolotl) == frozenset() and PassSchedule.from_config(axolotl).entries == []
    llama_factory = Config.from_any(trainable_config("llamafactory_ds_z3")).resolve(WORLD, model)
    assert llama_factory.zero_optimization.overlap_comm is False
    assert llama_factory.bf16.enabled is False and llama_factory.fp16.enabled is False  # fp32 model
    assert llama_factory.monitor_config["enabled"] is True  # kept, read by nothing, as DeepSpeed does
    assert optional_passes(llama_factory) == {"prefetch", "selective_gather"}


def _fixture_body(ctx, name: str, compile_backend: Optional[str]):
    import deepcompile

    torch._dynamo.reset()
    cfg = trainable_config(name)
    torch.manual_seed(0)
    model = HFTiny(CASES[name][3]).to(ctx.device)
    optimizer = lr_scheduler = None
    if "optimizer" not in cfg:
        # DeepSpeed-Chat passes its own optimizer and a scheduler factory to deepspeed.initialize.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        lr_scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))  # noqa: E731
    engine = deepcompile.initialize(model, optimizer, cfg, lr_scheduler=lr_scheduler)
    c = engine.config
    got = _derived(c)
    assert got == DERIVED[name], got
    if c.bf16.enabled:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    if compile_backend is not None:
        engine.compile(backend=compile_backend)

    gas, micro = c.gradient_accumulation_steps, c.train_micro_batch_size_per_gpu
    steps, lrs, losses = 4, [], []
    for micro_step in range(steps * gas):
        g = torch.Generator().manual_seed(100 * micro_step + ctx.rank)
        x = torch.randn(micro, 8, generator=g).to(ctx.device)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.micro_steps % gas == 0:
            lrs.append(engine.get_lr()[0])
    assert engine.global_steps == steps
    assert all(math.isfinite(v) for v in losses), losses
    if name in EXPECTED_LRS:
        assert lrs == pytest.approx(EXPECTED_LRS[name], rel=1e-6, abs=1e-12), lrs
    else:
        assert lrs == pytest.approx([1e-3 / (1 + t) for t in range(1, steps + 1)]), lrs
    state = engine.full_state_dict(all_ranks=True)
    torch.manual_seed(0)
    init = HFTiny(CASES[name][3]).state_dict()
    moved = [k for k in init if not torch.equal(state[k].float(), init[k].float())]
    if any(lrs[:-1]):
        assert moved, "no parameter changed"
    engine.destroy()


TRAINABLE = sorted(n for n, c in CASES.items() if (c[2] is not None or not c[1]) and n not in RESOLVE_ONLY)


@pytest.mark.parametrize("name", TRAINABLE)
def test_config_trains(name):
    run_distributed(_fixture_body, WORLD, args=(name, None), timeout=300)


def test_dschat_config_trains_compiled():
    run_distributed(_fixture_body, WORLD, args=("dschat_train_zero3_bf16", "eager"), timeout=600)


# ---- engine features switched on by DeepSpeed keys


class _MLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(7, 13, dtype=dtype)
        self.fc2 = nn.Linear(13, 5, dtype=dtype)

    def forward(self, x, y):
        return ((self.fc2(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype)))) - y).float() ** 2).mean()


def _run(ctx, cfg, steps=3, dtype=torch.float32, optimizer=None, on_engine: Optional[Callable] = None):
    import deepcompile

    torch.manual_seed(0)
    model = _MLP(dtype).to(ctx.device)
    if optimizer is None and "optimizer" not in cfg:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    elif callable(optimizer):
        optimizer = optimizer(model)
    engine = deepcompile.initialize(model, optimizer, cfg)
    if on_engine is not None:
        on_engine(engine)
    gas = engine.gradient_accumulation_steps
    for step in range(steps * gas):
        g = torch.Generator().manual_seed(10 * step + ctx.rank)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
        engine.backward(engine(x.to(ctx.device), y.to(ctx.device)))
        engine.step()
    state = engine.full_state_dict(all_ranks=True)
    return engine, state


def _bf16_cast_body(ctx, stage):
    from deepcompile import runtime

    engine, state = _run(ctx, {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    assert all(v.dtype == torch.bfloat16 for v in state.values())  # parameters trained as bf16
    if stage == 3:
        assert {runtime.gather_dtype(i) for i in engine.sharding.ds_id_of.values()} == {torch.bfloat16}
        assert all(sp.shard.dtype == torch.float32 for sp in engine.sharding.params)  # fp32 masters
    else:
        assert all(g.master.dtype == torch.float32 for g in engine.sharding.groups)
    engine.destroy()
    # bf16 off: the model keeps its dtype
    engine, state = _run(ctx, {"zero_optimization": {"stage": stage}})
    assert all(v.dtype == torch.float32 for v in state.values())
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_enabled_casts_the_parameters(stage):
    run_distributed(_bf16_cast_body, WORLD, args=(stage,))


def _comm_dtype_body(ctx):
    from deepcompile import runtime

    seen = []

    def watch(engine):
        def pre_step(optimizer, args, kwargs):
            seen.append({runtime.grad_target(sp.ds_id).dtype for sp in engine.sharding.params
                         if runtime.holds_grad_target(sp.ds_id)})
        engine.basic_optimizer.register_step_pre_hook(pre_step)

    base = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}
    engine, got = _run(ctx, {**base, "communication_data_type": "bf16"}, on_engine=watch)
    engine.destroy()
    assert seen and all(s == {torch.bfloat16} for s in seen), seen  # reduced into bf16 partitions
    seen.clear()
    engine, ref = _run(ctx, {**base, "communication_data_type": "fp32"}, on_engine=watch)
    engine.destroy()
    assert seen and all(s == {torch.float32} for s in seen), seen
    for k in ref:  # the same training, up to bf16 rounding of the averaged gradients
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=2e-2)
        assert not torch.equal(got[k], ref[k]) or k.endswith("bias")


def test_communication_data_type_bf16_zero3():
    run_distributed(_comm_dtype_body, WORLD)


def _allgather_bucket_body(ctx, stage):
    runs = []
    for bucket in (500_000_000, 10, 1):  # one collective per group; chunks of 5; chunks of 1 element per rank
        cfg = {"zero_optimization": {"stage": stage, "allgather_bucket_size": bucket}, "bf16": {"enabled": True}}
        engine, state = _run(ctx, cfg, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        engine.destroy()
        runs.append(state)
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]) and torch.equal(runs[0][k], runs[2][k]), k


@pytest.mark.parametrize("stage", [1, 2])
def test_allgather_bucket_size_chunks_the_gather_of_updated_partitions(stage):
    run_distributed(_allgather_bucket_body, WORLD, args=(stage,))


def _report_body(ctx):
    cfg = {"zero_optimization": {"stage": 3}, "steps_per_print": 2, "wall_clock_breakdown": True,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}}
    lines = []
    engine, _ = _run(ctx, cfg, steps=4, on_engine=lambda e: lines.append(e.step_report))
    report = lines[0]
    if ctx.rank == 0:
        # step 4 ran with i = 3, after the warm-up: the optimizer's 0.1
        assert report.last_line.startswith("step 4: lr 0.1 | loss "), report.last_line
        assert "| ms per step: forward " in report.last_line
        assert "backward" in report.last_line and "| step " in report.last_line
    else:
        assert report.last_line is None  # only rank 0 reports
    engine.destroy()
    engine, _ = _run(ctx, {"zero_optimization": {"stage": 1}, "steps_per_print": 3}, steps=3)
    if ctx.rank == 0:
        # No timing without wall_clock_breakdown (tests/engine/test_step_report.py checks the other values).
        assert engine.step_report.last_line.startswith("step 3: lr 0.02 | loss ")
        assert "ms per step" not in engine.step_report.last_line
    assert engine.step_report.totals_ms == {"forward": 0.0, "backward": 0.0, "step": 0.0}
    engine.destroy()


def test_steps_per_print_and_wall_clock_breakdown():
    run_distributed(_report_body, WORLD)


def _gate_body(ctx):
    with pytest.raises(ValueError, match="zero_allow_untested_optimizer"):
        _run(ctx, {"zero_optimization": {"stage": 2}}, optimizer=lambda m: torch.optim.Adagrad(m.parameters()))
    # (Adagrad itself cannot be partitioned: it creates its state at construction.)
    engine, _ = _run(ctx, {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True},
                     optimizer=lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01))
    assert type(engine.basic_optimizer) is torch.optim.RMSprop
    engine.destroy()


def test_untested_optimizer_needs_the_flag():
    run_distributed(_gate_body, WORLD)


def _initialize_errors_body(ctx):
    import deepcompile

    model = _MLP().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters())
    section = {"type": "AdamW", "params": {"lr": 0.1}}
    with pytest.raises(ValueError, match="got an optimizer and the config has an 'optimizer' section"):
        deepcompile.initialize(model, opt, {"zero_optimization": {"stage": 1}, "optimizer": section})
    with pytest.raises(ValueError, match="needs an optimizer"):
        deepcompile.initialize(model, None, {"zero_optimization": {"stage": 1}})
    with pytest.raises(TypeError, match="needs a config"):
        deepcompile.initialize(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match="got an lr_scheduler and the config has a 'scheduler' section"):
        deepcompile.initialize(model, opt, {"zero_optimization": {"stage": 3},
                                            "scheduler": {"type": "WarmupLR"}}, lr_scheduler=sched)


def test_initialize_refuses_ambiguous_or_missing_inputs():
    run_distributed(_initialize_errors_body, WORLD)
