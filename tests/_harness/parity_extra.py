"""Extra parity models for ZeRO-1/2: a first graph without reductions, zero-sized parameters."""

import torch
import torch.nn as nn

from _harness.parity_cases import MLP, MODELS


class FrozenFirstGraph(MLP):
    """Two graphs; the first holds only frozen parameters, so its backward reduces nothing."""

    def __init__(self):
        super().__init__()
        self.fc1.weight.requires_grad_(False)
        self.fc1.bias.requires_grad_(False)

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.fc1(x))
        torch._dynamo.graph_break()
        return ((self.fc2(h) - y) ** 2).mean()


class WithEmptyParam(MLP):
    """A zero-sized parameter and one that never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.empty(0))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x, y):
        return super().forward(x, y) + self.empty.sum()


MODELS.setdefault("frozen_first_graph", FrozenFirstGraph)
MODELS.setdefault("with_empty", WithEmptyParam)
