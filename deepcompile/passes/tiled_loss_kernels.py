"""The kernels of ``dcloss::linear_cross_entropy`` and its backward (schemas: deepcompile/ops.py).

A causal LM's last step, ``cross_entropy(hidden @ lm_head.T, labels)``, materialises logits of
``tokens x vocab``: at 64k tokens and Llama-3's 128k vocabulary, 17 GB in bf16, and transformers'
fp32 upcast, the saved log-softmax and the logits' gradient add about 100 GB more. These kernels
compute the same loss ``chunk`` tokens at a time: each chunk's logits are made, reduced to its
summed loss and dropped, and the backward recomputes them chunk by chunk. Each chunk follows the
arithmetic of the untiled code exactly (a matmul in the inputs' dtype, the upcast, fp32 cross
entropy; the gradient cast back before the matmuls), so the results differ from it only in the
order the per-chunk sums are added.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from deepcompile import ops


def _chunks(tokens: int, chunk: int):
    step = max(1, chunk)
    for start in range(0, tokens, step):
        yield start, min(tokens, start + step)


def _valid_count(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (labels != ignore_index).sum().to(torch.float32)


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"dcloss::linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1 or hidden.shape[0] != labels.shape[0] \
            or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"dcloss::linear_cross_entropy: hidden [tokens, features], weight [vocab, features] and "
                         f"labels [tokens] expected, got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
                         f"{tuple(labels.shape)}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                         reduction: str, chunk: int) -> torch.Tensor:
    _check(hidden, weight, labels, reduction)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, end in _chunks(hidden.shape[0], chunk):
        logits = (hidden[start:end] @ weight.t()).float()
        total = total + F.cross_entropy(logits, labels[start:end], ignore_index=ignore_index, reduction="sum")
    if reduction == "mean":  # as torch's mean: over the labels that count (0 of them: nan)
        total = total / _valid_count(labels, ignore_index)
    return total


def linear_cross_entropy_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                  labels: torch.Tensor, ignore_index: int, reduction: str,
                                  chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    _check(hidden, weight, labels, reduction)
    scale = grad.to(torch.float32)
    if reduction == "mean":
        scale = scale / _valid_count(labels, ignore_index)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start, end in _chunks(hidden.shape[0], chunk):
        h, y = hidden[start:end], labels[start:end]
        logits = (h @ weight.t()).float()
        # d(sum of cross entropy)/d(logits) = softmax - one_hot(label), zero for ignored labels
        g = torch.softmax(logits, dim=-1)
        counted = y != ignore_index
        rows = torch.arange(y.shape[0], device=y.device)[counted]
        g[rows, y[counted]] -= 1
        g = (g * counted.unsqueeze(-1) * scale).to(hidden.dtype)
        grad_hidden[start:end] = g @ weight
        grad_weight += (g.t() @ h).float()
    return grad_hidden, grad_weight.to(weight.dtype)


ops.register_tiled_loss_kernels(linear_cross_entropy, linear_cross_entropy_backward)
