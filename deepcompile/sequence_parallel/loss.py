"""The loss over every token of the global sequence, from each rank's mean over its slice.

Each rank's model returns the mean loss over the valid labels of its slice. The global mean weighs
each slice by its count of valid labels: ``sum_r n_r * l_r / sum_r n_r``. The gather is
differentiable, so each rank's backward of the (identical) global loss sends
``P * n_r / N`` back into its own slice's loss: summed over the group's ranks, that is the gradient
of the global mean ``P`` times over, which ZeRO's average over ``P`` times as many ranks as there
are data-parallel replicas divides out (docs/design/sequence-parallel.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepcompile.sequence_parallel.batch import IGNORE_INDEX


class _GatherScalars(torch.autograd.Function):
    """Every rank's scalar, stacked in group order; differentiable. Each rank's backward holds the
    gradient of its own copy of what was computed from the stack; the gradient reaching rank r's
    scalar is the sum of all ranks' gradients at position r: one all-reduce of the stack.
    (torch.distributed.nn.functional.all_gather's gloo backward reduces to group-local indices as
    if they were global ranks, which fails on every group but the first.)"""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.index = dist.get_group_rank(group, dist.get_rank())
        stacked = value.new_empty(dist.get_world_size(group))
        dist.all_gather_into_tensor(stacked, value.reshape(1).contiguous(), group=group)
        return stacked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed[ctx.index], None


def global_token_mean(loss: torch.Tensor, shift_labels: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The mean of the per-token loss over the whole sequence, from this rank's ``loss`` (the mean
    over its slice's valid labels) and its slice's ``shift_labels``. A slice with no valid label
    counts for nothing (its mean is NaN or 0, never read)."""
    valid = (shift_labels != IGNORE_INDEX).sum().to(loss.dtype)
    losses = _GatherScalars.apply(loss.reshape(()), group)
    with torch.no_grad():
        counts = _GatherScalars.apply(valid, group)
    weighted = torch.where(counts > 0, losses * counts, torch.zeros_like(losses))
    return weighted.sum() / counts.sum().clamp(min=1)
