"""Gradient clipping by the global L2 norm over partitioned gradients (every ZeRO stage)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from deepcompile import compat


def local_square_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of ``grads`` (this rank's part of the global norm), fp64 on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(compat.foreach_norm(grads)).double().pow(2).sum()


def clip_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float, group: Optional[dist.ProcessGroup],
                    device: torch.device, spent_square: Optional[torch.Tensor] = None,
                    grad_scale: Optional[float] = None) -> torch.Tensor:
    """Scale ``grads`` in place so that the L2 norm of all ranks' gradients together is at most
    ``max_norm`` (no scaling when ``max_norm <= 0``); returns that norm (fp32, on ``device``).

    Each rank holds a disjoint part of the gradients, so the squares of the local norms add up
    over the ranks to the square of the global norm: one all-reduce of a scalar. The sum runs in
    fp64, so many small partitions (one per ZeRO-3 parameter) add up without loss. A rank with no
    gradient still joins the all-reduce (with 0), on ``device``.

    ``spent_square``: the sum of squares of gradients this rank already stepped and dropped in
    this window (``compile.optimizer_step_in_backward``): they count in the norm; nothing scales
    them (that option refuses clipping).

    ``grad_scale``: the fp16 loss scale the gradients carry (precision/loss_scaler.py). They are
    unscaled together with the clipping (one multiplication), and the norm returned is that of
    the unscaled gradients. A non-finite norm is an overflow on some rank: the gradients are then
    left as they are, for the caller to drop (this reads the norm on the host).
    """
    local_sq = local_square_norm(grads, device)
    if spent_square is not None:
        local_sq = local_sq + spent_square
    dist.all_reduce(local_sq, group=group)
    if grad_scale is None:
        norm = local_sq.sqrt().float()
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1:
                compat.foreach_mul_(grads, coef)
        return norm
    norm = (local_sq.sqrt() / grad_scale).float()
    if not bool(torch.isfinite(norm)):
        return norm
    if max_norm > 0:
        # The clipping factor as the unscaled path computes it (fp32, at most 1), times 1/scale.
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0) / grad_scale
        compat.foreach_mul_(grads, coef)
    elif grad_scale != 1.0:
        compat.foreach_mul_(grads, 1.0 / grad_scale)
    return norm
