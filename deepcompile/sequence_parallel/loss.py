"""The loss over every token of the global sequence, from each rank's mean over its slice.

Each rank's model returns the mean loss over the valid labels of its slice. The global mean weighs
each slice by its count of valid labels: ``sum_r n_r * l_r / sum_r n_r``. The gather is
differentiable, so each rank's backward of the (identical) global loss sends
``P * n_r / N`` back into its own slice's loss: summed over the group's ranks, that is the gradient
of the global mean ``P`` times over, which ZeRO's average over ``P`` times as many ranks as there
are data-parallel replicas divides out (docs/design/sequence-parallel.md).

Programs combine the slices' losses in one of two ways, and ``gradient_factor`` tells them apart
from the loss's autograd graph. Through a differentiable collective (this module,
transformers <= 5.24's ``deepspeed_sp_compute_loss``, accelerate's ALST example): every rank
back-propagates the global loss, ``P`` times over in all, and the average over the world is right.
As this rank's share only (transformers >= 5.25: ``local_sum + (total - local_sum.detach())``,
written for DeepSpeed >= 0.20.2, which sums gradients over the sequence-parallel group): no
collective is in the graph, and the share's gradient is scaled by ``P`` so that the same average
sums the group's shares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepcompile.sequence_parallel.batch import IGNORE_INDEX

# Backward nodes of differentiable collectives: torch.distributed.nn.functional's and this module's.
_COLLECTIVE_NODE_MARKERS = ("AllGather", "AllReduce", "Reduce_Scatter", "AlltoAll", "_GatherScalars")
# Where the walk stops: the model's own compiled graph (the combination happens after it), and a
# bound on the nodes looked at (the combination sits within a few nodes of the loss).
_COMPILED_NODE = "CompiledFunctionBackward"
_MAX_NODES = 256


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


def holds_differentiable_collective(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s autograd graph, near the loss, holds a differentiable collective (a
    gather or all-reduce of the slices' losses): then every rank back-propagates the global loss.
    The walk does not enter compiled graphs and looks at most at ``_MAX_NODES`` nodes."""
    seen, frontier = set(), [loss.grad_fn]
    while frontier and len(seen) < _MAX_NODES:
        node = frontier.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if any(marker in name for marker in _COLLECTIVE_NODE_MARKERS):
            return True
        if name == _COMPILED_NODE:
            continue
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return False


def gradient_factor(loss: torch.Tensor, size: int) -> int:
    """What this rank's ``loss`` is multiplied by before its backward, with ``size`` ranks per
    sequence and gradients averaged over the world: 1 for a loss combined through a differentiable
    collective, ``size`` for a rank's own share (see the module docstring)."""
    return 1 if size == 1 or holds_differentiable_collective(loss) else size
