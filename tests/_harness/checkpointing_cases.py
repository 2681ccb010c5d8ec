"""Parity models with activation checkpointing (registered into parity_cases.MODELS on import).

Every model here recomputes its decoder layers in the backward: ``torch.utils.checkpoint`` around
each layer (both implementations), or transformers' own switch on real models. The single-process
reference trains the very same model (with the same checkpointing), so parity says that sharded
training with recomputation computes what plain training does.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from _harness.parity_cases import MODELS, TOKEN_MODELS, tiny_llama, tiny_qwen2_moe


class DecoderLayer(nn.Module):
    """A pre-norm residual block. Biases and the norm's shift matter here: no gradient formula
    reads them, so a backward gathers them only to recompute the layer's forward."""

    def __init__(self, dim=7, hidden=11):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class CheckpointedDecoder(nn.Module):
    """Input projection, three decoder layers, head. ``use_reentrant``: None runs the layers
    plainly, True/False wraps each in ``torch.utils.checkpoint.checkpoint`` with that setting.

    The input projection makes the layers' input require grad, as a token embedding does in a
    language model: the reentrant implementation computes no parameter gradients otherwise."""

    use_reentrant = None

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 7)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(3)])
        self.head = nn.Linear(7, 5)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            if self.use_reentrant is None:
                h = layer(h)
            else:
                h = checkpoint(layer, h, use_reentrant=self.use_reentrant)
        return ((self.head(h) - y) ** 2).mean()


class NonReentrantDecoder(CheckpointedDecoder):
    use_reentrant = False


class ReentrantDecoder(CheckpointedDecoder):
    use_reentrant = True


def enable_hf_checkpointing(model: nn.Module, kwargs=None) -> nn.Module:
    """transformers' switch, by the name users call (deprecated in favour of
    ``activation_checkpointing_enable`` from transformers 5.2x, which it forwards to)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if kwargs is None:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


class _HFLoss(nn.Module):
    """A transformers causal LM with its layers checkpointed; forward returns the loss."""

    make = staticmethod(tiny_llama)
    kwargs = None

    def __init__(self):
        super().__init__()
        self.model = enable_hf_checkpointing(self.make(), self.kwargs)

    def forward(self, tokens, targets):
        return self.model(input_ids=tokens, labels=targets).loss


class LlamaCheckpointed(_HFLoss):
    pass  # transformers' default: use_reentrant=False


class LlamaCheckpointedReentrant(_HFLoss):
    kwargs = {"use_reentrant": True}


class Qwen2MoeCheckpointed(_HFLoss):
    make = staticmethod(tiny_qwen2_moe)


CHECKPOINTED_MODELS = {
    "decoder": CheckpointedDecoder,  # the same model without checkpointing, for comparisons
    "decoder_ckpt": NonReentrantDecoder,
    "decoder_ckpt_reentrant": ReentrantDecoder,
    "llama_ckpt": LlamaCheckpointed,
    "llama_ckpt_reentrant": LlamaCheckpointedReentrant,
    "qwen2_moe_ckpt": Qwen2MoeCheckpointed,
}
for _name, _cls in CHECKPOINTED_MODELS.items():
    MODELS.setdefault(_name, _cls)
TOKEN_MODELS.setdefault("llama_ckpt", 61)
TOKEN_MODELS.setdefault("llama_ckpt_reentrant", 61)
TOKEN_MODELS.setdefault("qwen2_moe_ckpt", 61)


class _BrokenLayer(DecoderLayer):
    """A layer Dynamo cannot trace in one piece: checkpointing it cannot become part of a graph."""

    def forward(self, x):
        h = torch.tanh(self.up(self.norm(x)))
        torch._dynamo.graph_break()
        return x + self.down(h)


class BrokenNonReentrantDecoder(NonReentrantDecoder):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_BrokenLayer() for _ in range(3)])


class BrokenReentrantDecoder(ReentrantDecoder):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_BrokenLayer() for _ in range(3)])


MODELS.setdefault("broken_ckpt", BrokenNonReentrantDecoder)
MODELS.setdefault("broken_ckpt_reentrant", BrokenReentrantDecoder)
