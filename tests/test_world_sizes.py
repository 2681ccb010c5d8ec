"""Training parity at world sizes 3 and 4 (gloo on CPU; with DC_TEST_DEVICE=cuda, as many GPUs).

The rest of the suite trains on 2 ranks. Sharding arithmetic (padding to a multiple of the world,
partitions that split a parameter across several owners, the last rank's padding tail) only shows
all its cases with more ranks, so the main paths run here at 3 and 4: ZeRO-3 with the
profile-guided passes on, ZeRO-1 and ZeRO-2 with gradient accumulation. Compared, as everywhere,
against single-process training on the same global batches.
"""

from __future__ import annotations

import pytest

from _harness.multiproc import require_world_size, run_distributed
from _harness.parity_cases import assert_parity, train_engine, train_reference
from test_zero3_parity import FP32_TOL


def _z3_body(ctx):
    cfg = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 10,
                              "stage3_prefetch_bucket_size": 40},
        "compile": {"warmup_steps": 2},
    }
    got, engine = train_engine("mlp", 5, cfg, "eager", ctx.device)
    assert_parity(got, train_reference("mlp", 5, device=ctx.device), **FP32_TOL)
    assert engine.schedule_report()["graphs"], "the profile-guided passes did not run"
    engine.destroy()


def _z12_body(ctx, stage):
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 48}, "gradient_accumulation_steps": 2}
    got, engine = train_engine("mlp", 6, cfg, "eager", ctx.device)
    assert_parity(got, train_reference("mlp", 6, gas=2, device=ctx.device), **FP32_TOL)
    engine.destroy()


@pytest.mark.parametrize("world", [3, 4])
def test_zero3_with_passes_at_world_size(world):
    require_world_size(world)
    run_distributed(_z3_body, world_size=world, timeout=300)


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_accumulation_at_world_size(world, stage):
    require_world_size(world)
    run_distributed(_z12_body, world_size=world, args=(stage,), timeout=300)
