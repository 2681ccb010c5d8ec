"""Checkpoints across layouts: saved under hybrid sharding (4 ranks as 2 shard groups of 2), loaded
by 3 ranks sharding plainly (1x3), ZeRO-3 and ZeRO-2; the same engine's full state dict and
Hugging Face export come from the world's rank 0 only.

Replicas hold the same pieces, and only the first shard group writes them: every stored tensor is
written as chunks that tile it once (DCP refuses overlapping chunks). Loading copies, so the
loaded parameters and optimizer state equal the saved run's bitwise; training on from there
matches single-process training over all the steps (tests/checkpoint/test_checkpoint.py's
tolerance: other slices per rank, other reduction order).
"""

from __future__ import annotations

import os

import pytest
import torch

from _harness.multiproc import require_world_size, run_distributed
from test_checkpoint import TIMEOUT, _full_optimizer_state, _model, _state, _train, assert_resumed
from _harness.parity_cases import make_optimizer

SAVED_STEPS, MORE_STEPS = 3, 2
STAGES = (3, 2)


def _engine(ctx, stage, shard_group_size=None, seed=1234):
    import deepcompile

    torch._dynamo.reset()
    model = _model("mlp", seed, ctx.device)
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 10}}
    return deepcompile.initialize(
        model, make_optimizer(model.parameters()), cfg, shard_group_size=shard_group_size,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))


def _save_body(ctx, root):
    import torch.distributed.checkpoint as dcp

    for stage in STAGES:
        engine = _engine(ctx, stage, shard_group_size=2)
        assert engine.topology.hybrid
        losses = _train(engine, ctx, "mlp", SAVED_STEPS)
        path = engine.save_checkpoint(os.path.join(root, f"zero{stage}"), tag="hybrid")
        expected = {"losses": losses, "state": _state(engine), "opt": _full_optimizer_state(engine),
                    "lr": engine.get_lr()}
        if ctx.rank == 0:
            torch.save(expected, os.path.join(root, f"expected{stage}.pt"))
            # Chunks from the first shard group only (at most one per rank of it), tiling each
            # tensor once: a replica's copy of a piece is not written again.
            metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            for name, p in _model("mlp").named_parameters():
                chunks = sorted((c.offsets[0], c.sizes[0]) for c in metadata[f"model/{name}"].chunks)
                ends = [0] + [offset + size for offset, size in chunks]
                assert len(chunks) <= 2 and [offset for offset, _ in chunks] == ends[:-1] and ends[-1] == p.numel(), \
                    (name, chunks)
        _exports_once_from_rank_0(ctx, engine, os.path.join(root, f"hf{stage}"), expected["state"])
        engine.destroy()


def _exports_once_from_rank_0(ctx, engine, folder, full):
    """Every shard group's first rank receives full parameters when they are gathered; the world's
    rank 0 alone returns them from full_state_dict() and writes the safetensors export."""
    from safetensors.torch import load_file

    state = engine.full_state_dict()
    assert bool(state) == (ctx.rank == 0), f"rank {ctx.rank} got {sorted(state)}"
    engine.save_hf(folder)
    exported = load_file(os.path.join(folder, "model.safetensors"))
    assert exported.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(exported[key], value), key


def _load_body(ctx, root):
    for stage in STAGES:
        engine = _engine(ctx, stage, seed=999)
        assert not engine.topology.hybrid
        engine.load_checkpoint(os.path.join(root, f"zero{stage}"))
        expected = torch.load(os.path.join(root, f"expected{stage}.pt"), weights_only=False)
        assert_resumed(engine, ctx, "mlp", expected, SAVED_STEPS, MORE_STEPS, f"ZeRO-{stage} ")
        engine.destroy()


@pytest.mark.world_size(4, 3)
def test_hybrid_checkpoint_loads_at_another_layout(tmp_path):
    require_world_size(4)
    root = str(tmp_path)
    run_distributed(_save_body, 4, args=(root,), timeout=TIMEOUT)
    run_distributed(_load_body, 3, args=(root,), timeout=TIMEOUT)
