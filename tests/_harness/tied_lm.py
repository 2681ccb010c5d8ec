"""A tiny language model with a tied parameter (embedding and head) and a persistent buffer: the
checkpoint tests' model (what consolidation must name once and keep)."""

import torch
import torch.nn as nn


class TiedBufferedLM(nn.Module):
    """A tied parameter (embedding and head) and a persistent buffer."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, 7)
        self.out = nn.Linear(7, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(dim, dtype=torch.float32))

    def forward(self, tokens, targets):
        h = self.out(torch.tanh(self.mix(self.embed(tokens)))) * self.scale
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())
