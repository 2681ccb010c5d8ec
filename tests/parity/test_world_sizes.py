"""Training parity at world sizes 3 and 4 (gloo on CPU; with DC_TEST_DEVICE=cuda, as many GPUs).

The rest of the suite trains on 2 ranks. Sharding arithmetic (padding to a multiple of the world,
partitions that split a parameter across several owners, the last rank's padding tail) only shows
all its cases with more ranks, so the main paths run here at 3 and 4: ZeRO-3 with the
profile-guided passes on, ZeRO-1 and ZeRO-2 with gradient accumulation. Compared, as everywhere,
against single-process training on the same global batches.

The first tests here are CPU unit tests of how the suites pick their world sizes
(``_harness/multiproc.py``) under ``DC_TEST_DEVICE=cuda``, with the GPU count faked: every suite
must run at a size the GPUs present can host (one GPU: world size 1), and a test that needs more
ranks than there are GPUs must skip with the reason, never fail.
"""

from __future__ import annotations

import pytest
import torch

from _harness import multiproc
from _harness.multiproc import require_world_size, run_distributed
from _harness.parity_cases import assert_parity, train_engine, train_reference
from test_zero3_parity import FP32_TOL

# ----------------------------------------------------------------------------------------------
# world-size selection (no processes started)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_device(monkeypatch):
    """Sets DC_TEST_DEVICE and DC_TEST_WORLD_SIZES (None: unset) and fakes the GPU count."""

    def apply(device, gpus=None, sizes=None):
        monkeypatch.setenv("DC_TEST_DEVICE", device)
        if sizes is None:
            monkeypatch.delenv("DC_TEST_WORLD_SIZES", raising=False)
        else:
            monkeypatch.setenv("DC_TEST_WORLD_SIZES", sizes)
        if gpus is not None:
            monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    return apply


def _skips(world_size):
    try:
        require_world_size(world_size)
    except pytest.skip.Exception:
        return True
    return False


@pytest.mark.parametrize(
    "device,gpus,sizes,parametrized,single",
    [
        # CPU: gloo ranks are processes, any size runs.
        pytest.param("cpu", None, None, (2, 3), 2, id="cpu-default"),
        pytest.param("cpu", None, "4", (4,), 4, id="cpu-env4"),
        pytest.param("cpu", None, "1,3", (1, 3), 3, id="cpu-env1_3"),
        # One GPU: no default size fits, so one rank; the single-size suites run at 1 too.
        pytest.param("cuda", 1, None, (1,), 1, id="gpus1-default"),
        # Two or more GPUs: the defaults stay (3 skips on 2 GPUs), the single size stays 2.
        pytest.param("cuda", 2, None, (2, 3), 2, id="gpus2-default"),
        pytest.param("cuda", 8, None, (2, 3), 2, id="gpus8-default"),
        # Explicit sizes are kept (those above the GPU count skip); the single size is capped.
        pytest.param("cuda", 1, "2,4", (2, 4), 1, id="gpus1-env2_4"),
        pytest.param("cuda", 2, "1,4", (1, 4), 2, id="gpus2-env1_4"),
        pytest.param("cuda", 4, "4", (4,), 4, id="gpus4-env4"),
        # No GPU: nothing fits; every size skips (run_distributed skips too).
        pytest.param("cuda", 0, None, (2, 3), 2, id="gpus0-default"),
    ],
)
def test_world_size_selection(fake_device, device, gpus, sizes, parametrized, single):
    fake_device(device, gpus, sizes)
    assert multiproc.world_sizes(default=(2, 3)) == parametrized
    assert multiproc.single_world_size() == single
    limit = multiproc.max_world_size()
    assert limit == (gpus if device == "cuda" else None)
    for n in parametrized + (single,):
        assert _skips(n) == (limit is not None and n > limit), f"world size {n} with {limit} GPUs"
    if limit != 0:
        # The property the GPU suites rely on: with at least one GPU the single-size suites run.
        assert not _skips(single)
        assert any(not _skips(n) for n in parametrized) or sizes is not None


@pytest.mark.world_size(2)
def test_run_distributed_skips_a_world_size_the_gpus_cannot_host(fake_device):
    """On one GPU, a body asked to run on 2 ranks skips with the reason instead of raising, and
    starts no process."""
    fake_device("cuda", gpus=1)
    pools = dict(multiproc._POOLS)
    with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs, 1 available"):
        run_distributed(_z3_body, world_size=2)
    assert multiproc._POOLS == pools, "a pool was started or dropped for a test that skips"


@pytest.mark.parametrize("sizes", ["0", "2,x", ",", "-1"])
def test_bad_world_size_list_is_rejected(fake_device, sizes):
    fake_device("cpu", sizes=sizes)
    with pytest.raises(ValueError, match="DC_TEST_WORLD_SIZES"):
        multiproc.world_sizes()
    with pytest.raises(ValueError, match="DC_TEST_WORLD_SIZES"):
        multiproc.single_world_size()


# ----------------------------------------------------------------------------------------------
# training parity at 3 and 4 ranks
# ----------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("world", [3, 4], ids=multiproc.ws_id)
def test_zero3_with_passes_at_world_size(world):
    require_world_size(world)
    run_distributed(_z3_body, world_size=world, timeout=300)


@pytest.mark.parametrize("world", [3, 4], ids=multiproc.ws_id)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_accumulation_at_world_size(world, stage):
    require_world_size(world)
    run_distributed(_z12_body, world_size=world, args=(stage,), timeout=300)
