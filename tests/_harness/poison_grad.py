"""An injected fp16 overflow: ``PoisonGrad.apply(x)`` is x in the forward, and the backward writes
inf into one element of x's gradient. Shared by the engine-level fp16 tests and the Trainer
probe (which runs as a torchrun script from this folder, so it imports this module by its bare
name)."""

from __future__ import annotations

import math

import torch


class PoisonGrad(torch.autograd.Function):
    """Identity forward; the backward writes inf into one element of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad
