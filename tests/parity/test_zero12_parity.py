"""ZeRO-1 and ZeRO-2 end to end against single-process training (2 ranks).

Same tolerances as the ZeRO-3 suite (see test_zero3_parity.py). Also checks the seed-001
invariant: during the optimizer step the runtime references no gradient target and no reduce
bucket.
"""

from __future__ import annotations

import pytest
import torch

from _harness import parity_extra  # noqa: F401  (registers the extra models)
from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import train_engine, train_reference, assert_parity
from test_zero3_parity import BF16_TOL, CLIP, FP32_TOL, INDUCTOR_TOL, assert_clipping_binds

WORLD = single_world_size()  # 2 (or DC_TEST_WORLD_SIZES), at most the GPU count
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)


def config(stage, **extra):
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 48}}
    cfg.update(extra)
    return cfg


def _check_lifetimes_during_step(engine):
    """The optimizer step runs while the runtime holds no gradient target, no reduce bucket and no
    pending reduce task: gradient targets are bound for one step only."""
    from deepcompile import runtime

    seen = []

    def pre_step(optimizer, args, kwargs):
        held = [i for i in engine.sharding.ds_id_of.values() if runtime.holds_grad_target(i)]
        seen.append((held, runtime.reduce_bucket_numel(), runtime.pending_reduce_tasks()))

    engine.optimizer.register_step_pre_hook(pre_step)
    return seen


def _body(ctx, name, stage, backend, steps, gas=1, bf16=False, clip=0.0, optimizer="adamw"):
    import deepcompile.engine as engine_mod

    cfg = config(stage, gradient_accumulation_steps=gas, gradient_clipping=clip)
    seen = []
    original_init = engine_mod.Engine.__init__

    def init_and_watch(self, *a, **k):
        original_init(self, *a, **k)
        seen.extend([])  # keep a reference for the closure below
        self._lifetime_log = _check_lifetimes_during_step(self)

    engine_mod.Engine.__init__ = init_and_watch
    try:
        got, engine = train_engine(name, steps, cfg, backend, ctx.device,
                                   dtype=torch.bfloat16 if bf16 else torch.float32, optimizer=optimizer)
    finally:
        engine_mod.Engine.__init__ = original_init
    ref = train_reference(name, steps, gas=gas, clip=clip, device=ctx.device, optimizer=optimizer)
    tol = BF16_TOL if bf16 else INDUCTOR_TOL if backend == "inductor" else FP32_TOL
    assert_parity(got, ref, **tol)
    if clip > 0:
        assert_clipping_binds(got, clip)
    log = engine._lifetime_log
    assert len(log) == steps // gas, log  # one optimizer step per window
    for held, bucket_numel, pending in log:
        assert held == [] and bucket_numel == 0 and pending == 0, (held, bucket_numel, pending)
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    "name,backend",
    [("mlp", None), ("mlp", "eager"), ("llama", "eager"), ("lora", "eager"), ("frozen_first_graph", "eager"),
     ("with_empty", "eager"), ("graph_break", "eager"), ("partly_disabled", "eager"),
     # One compiled half of a block's forward called for every block (Dynamo reuses it): each
     # call must reduce into its own block's partitions, not the first block's.
     ("repeated_broken_blocks", "eager"), ("custom_op_experts", "inductor")],
)
def test_zero12_parity(stage, name, backend):
    run_distributed(_body, WORLD, args=(name, stage, backend, 4), timeout=300)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_qwen2_moe_inductor(stage):
    """The ZeRO-1/2 variants of the ZeRO-3 Qwen2-MoE regression (test_zero3_qwen2_moe)."""
    run_distributed(_body, WORLD, args=("qwen2_moe", stage, "inductor", 4), timeout=900)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_gradient_accumulation_many_windows(stage):
    run_distributed(_body, WORLD, args=("mlp", stage, "eager", 16), kwargs={"gas": 4})


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_bf16(stage):
    run_distributed(_body, WORLD, args=("mlp", stage, "eager", 4), kwargs={"bf16": True})


def test_zero1_bf16_accumulation_inductor():
    run_distributed(_body, WORLD, args=("mlp", 1, "inductor", 8), kwargs={"gas": 4, "bf16": True}, timeout=300)


def test_zero2_clipping():
    run_distributed(_body, WORLD, args=("mlp", 2, "eager", 4), kwargs={"clip": CLIP})


# SGD with momentum (see test_zero3_sgd_momentum): scale errors of the gradients show in the
# parameters, not only in the norms.
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("gas", [1, 4], ids=["plain", "accumulation"])
def test_zero12_sgd_momentum(stage, gas):
    run_distributed(_body, WORLD, args=("mlp", stage, "eager", 4 * gas), kwargs={"gas": gas, "optimizer": "sgd_momentum"})


def _unimplemented_settings_body(ctx):
    import warnings

    import deepcompile

    model = torch.nn.Linear(3, 3).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # free_activation acts on compiled graphs: the engine run uncompiled refuses it at the forward.
    engine = deepcompile.initialize(model, opt, {"zero_optimization": {"stage": 3}, "compile": {"free_activation": True}})
    with pytest.raises(RuntimeError, match="compile.free_activation act on compiled graphs"):
        engine(torch.ones(2, 3, device=ctx.device))
    engine.destroy()
    model = torch.nn.Linear(3, 3).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A ZeRO-3-only schedule under ZeRO-1 does nothing: said, not ignored.
    schedule = [{"step": 1, "passes": ["prefetch"]}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = deepcompile.initialize(model, opt, {"zero_optimization": {"stage": 1}, "compile": {"schedule": schedule}})
    if ctx.rank == 0:
        assert any("compile.schedule holds ZeRO-3 passes only" in str(w.message) for w in caught), \
            [str(w.message) for w in caught]
    engine.destroy()


def test_unimplemented_settings_are_not_silently_ignored():
    run_distributed(_unimplemented_settings_body, WORLD)
