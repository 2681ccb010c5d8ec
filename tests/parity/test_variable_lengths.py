"""Batches whose sequence length changes from step to step and differs between ranks in a step
(packed or bucketed data loaders): Dynamo recompiles on some ranks and not on others, with
automatic dynamic shapes (``dynamic=None``), ``dynamic=True`` and ``torch._dynamo.mark_dynamic``.

Nothing may hang (a rank that recompiles while another does not must not leave a collective
unmatched), and training must equal the single-process reference that runs each rank's slice
separately and averages the ranks' gradients (what data parallelism computes when slices differ
in shape). Tolerance: fp32 with the eager inner compiler, the same reduction-order bound as the
other ZeRO parity tests (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import run_distributed
from _harness.parity_cases import build_model, make_optimizer

WORLD = 3
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
STEPS = 4
ROWS_PER_RANK = 2
TOL = dict(rtol=1e-5, atol=1e-6)


# Sequence length per step (rows) and rank (columns). Under automatic dynamic shapes a rank
# recompiles when its length first changes: at step 1 only rank 1 does, at step 2 ranks 0 and 2
# while rank 1 runs the graph it already has.
LENGTHS = [[5, 5, 7], [5, 6, 7], [4, 6, 3], [8, 8, 8]]


def lengths(step: int, world: int):
    return LENGTHS[step][:world]


def rank_batch(name: str, step: int, rank: int, world: int):
    vocab = {"tied": 11, "llama": 61}[name]
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (ROWS_PER_RANK, lengths(step, world)[rank]), generator=g)
    return tokens, tokens.clone()


def reference(name: str, world: int):
    model = build_model(name)
    opt = make_optimizer(list(model.parameters()))
    losses = []
    for step in range(STEPS):
        step_losses = [model(*rank_batch(name, step, r, world)) for r in range(world)]
        total = sum(step_losses) / world
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _body(ctx, name, stage, dynamic, compile_keys=None):
    import deepcompile

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(name, device=ctx.device)
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64,
                                 "stage3_param_persistence_threshold": 0},
           "compile": dict(compile_keys or {})}
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
    kwargs = {} if dynamic == "mark" else {"dynamic": {"auto": None, "true": True}[dynamic]}
    engine.compile(backend="eager", **kwargs)
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.to(ctx.device) for t in rank_batch(name, step, rank, world))
        if dynamic == "mark":
            torch._dynamo.mark_dynamic(tokens, 1)
            torch._dynamo.mark_dynamic(targets, 1)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if compile_keys:
        # The passes were planned from the profiled step and are in force.
        assert "prefetch" in engine.scheduler.applied.passes, engine.scheduler.applied.describe()
        assert engine.schedule_report(), "no schedule was planned"
    params = {k: v.float().cpu() for k, v in engine.full_state_dict(all_ranks=True).items()}
    ref_losses, ref_params = reference(name, world)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL,
                               msg=lambda m: f"{m}\nlosses {losses}\nreference {ref_losses}")
    for key, value in ref_params.items():
        torch.testing.assert_close(params[key], value, **TOL, msg=lambda m: f"{key}: {m}")
    engine.destroy()


@pytest.mark.parametrize("dynamic", ["auto", "true", "mark"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lengths_per_rank_per_step(stage, dynamic):
    # A hang fails the test at the harness's timeout, naming the ranks that did not finish.
    run_distributed(_body, WORLD, args=("tied", stage, dynamic), timeout=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_llama_lengths_per_rank_per_step(stage):
    run_distributed(_body, WORLD, args=("llama", stage, "auto"), timeout=600)


@pytest.mark.parametrize("dynamic", ["auto", "mark"])
def test_prefetch_schedule_with_lengths_per_rank(dynamic):
    """ZeRO-3 with the profile-guided passes switched on after one step: the profiled step and
    the re-planned graphs see shapes that differ between ranks."""
    run_distributed(_body, WORLD, args=("tied", 3, dynamic, {"warmup_steps": 1, "memory_budget_bytes": 1}),
                    timeout=300)
