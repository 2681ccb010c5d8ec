"""Random ops in a compiled forward (dropout, ``rand_like``, ``bernoulli``): they compile, and the
backward uses the masks the forward drew.

Inductor's joint-graph passes rewrite random ops to its own seeded kernels; they read Inductor's
fake mode, which the backend did not set while it ran those passes itself, so every model with
active dropout (GPT-2, BERT, T5 at their defaults) failed its first compile. Checked on two gloo
ranks through the engine: a module whose output shows the dropout mask (and a second random op
that must not change the first's mask); SGD at lr 1 makes the step's update the averaged
gradient, which must equal the one written from each rank's visible mask. Cases: ZeRO-3 with the
random ops inside an activation-checkpointed region (the backward recomputes them: it must draw
the same masks), and ZeRO-1; on GPUs (Inductor's CUDA random kernels) one rank per GPU. Tolerance: fp32 1e-6, sums of a few products.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from _harness.multiproc import run_distributed, single_world_size

N, P = 64, 0.5


class VisibleDropout(nn.Module):
    """``dropout(w * x)``, returned whole so the mask can be read from the output."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, N))
        self.checkpointed = checkpointed

    def _region(self, x):
        noise = torch.rand_like(x) + torch.bernoulli(torch.full_like(x, 0.5))  # other draws between
        return F.dropout(self.w * x, p=P, training=True), noise

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self._region, x, use_reentrant=False)
        return self._region(x)


def _body(ctx, stage: int, checkpointed: bool):
    import deepcompile

    torch.manual_seed(0)
    model = VisibleDropout(checkpointed).to(ctx.device)
    w0 = model.w.detach().clone()
    engine = deepcompile.initialize(model, None, {"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": stage},
                                                  "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    engine.compile("inductor")
    try:
        torch.manual_seed(10 + ctx.rank)  # each rank its own masks
        x = torch.linspace(1.0, 2.0, N, device=ctx.device) * (1 + ctx.rank)
        c = torch.linspace(-1.0, 1.0, N, device=ctx.device)
        out, noise = engine(x)
        kept = out.detach() != 0
        assert 0 < int(kept.sum()) < N, "dropout was not applied"
        assert torch.isfinite(noise).all()
        engine.backward((out * c).sum() + 0 * noise.sum())
        engine.step()
        grad = c * x / (1 - P) * kept  # this rank's gradient of w, from the mask its output shows
        torch.distributed.all_reduce(grad)
        expected = w0.to(ctx.device) - grad / ctx.world_size
        got = engine.full_state_dict(all_ranks=True)["w"]
        torch.testing.assert_close(got, expected.cpu(), rtol=1e-6, atol=1e-6)
        # The masks differ between steps: the generator advances.
        out2, _ = engine(x)
        assert not torch.equal(out2.detach() != 0, kept)
    finally:
        engine.destroy()


@pytest.mark.world_size(single_world_size())
@pytest.mark.parametrize("stage,checkpointed", [(3, True), (1, False)], ids=["zero3-checkpointed", "zero1"])
def test_random_ops_compile_and_the_backward_uses_the_forward_masks(stage, checkpointed):
    run_distributed(_body, single_world_size(), args=(stage, checkpointed), timeout=600)
