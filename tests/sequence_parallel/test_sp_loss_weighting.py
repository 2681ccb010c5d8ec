"""How a rank's loss under sequence parallelism is weighted (sequence_parallel/loss.py): a loss
combined through a differentiable collective (transformers <= 5.24 and accelerate's ALST example:
``torch.distributed.nn.functional.all_gather``; deepcompile's own ``global_token_mean``) is every
rank's whole loss and is averaged (factor 1); transformers >= 5.25's share
(``local_sum + (total - local_sum.detach())``, the total from an all-reduce of detached values)
is this rank's part and is summed over the group (factor: the group's size), also when the
slice's loss came out of a compiled graph. The launched Trainer tests
(tests/integrations/test_served_ulysses.py) check the gradients these factors give."""

from __future__ import annotations

import pytest
import torch

from _harness.multiproc import run_distributed


def _body(ctx):
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    from deepcompile.sequence_parallel.loss import global_token_mean, gradient_factor

    size = ctx.world_size
    w = torch.nn.Parameter(torch.ones(4))
    x = torch.arange(4.0) + ctx.rank
    compiled_slice_loss = torch.compile(lambda w, x: (w * x).mean(), backend="aot_eager")

    for slice_loss in ((w * x).mean(), compiled_slice_loss(w, x)):
        tokens = torch.tensor(4.0 + ctx.rank)
        gathered = torch.stack(dist_fn.all_gather(slice_loss, group=dist.group.WORLD))
        assert gradient_factor((gathered * 2).sum() / 3, size) == 1
        labels = torch.zeros(int(tokens), dtype=torch.long)
        assert gradient_factor(global_token_mean(slice_loss, labels, dist.group.WORLD), size) == 1
        local_sum = slice_loss * tokens
        totals = torch.stack((local_sum.detach(), tokens))
        dist.all_reduce(totals)
        share = (local_sum + (totals[0] - local_sum.detach())) / totals[1]
        assert gradient_factor(share, size) == size
        assert gradient_factor(slice_loss, size) == size
        assert gradient_factor(share, 1) == 1


@pytest.mark.world_size(2)
def test_a_share_of_the_loss_is_summed_and_a_gathered_loss_averaged():
    run_distributed(_body, 2)
