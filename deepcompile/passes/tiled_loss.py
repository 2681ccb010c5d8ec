"""The tiled-loss pass (``compile.tiled_loss``): a causal LM's loss without its logits.

It runs on the graph Dynamo captured, before aot_autograd. It looks for
``cross_entropy(view(float(linear(hidden, weight))), labels)`` (transformers' causal-LM losses:
the LM head's output upcast, flattened to ``[tokens, vocab]``) and replaces the cross-entropy
with ``dcloss::linear_cross_entropy(hidden, weight, labels)``, which makes the logits a chunk of
tokens at a time and never all at once (passes/tiled_loss_kernels.py). Only the unweighted loss
without label smoothing, reduced by "mean" or "sum", is replaced; anything else is left alone.

The model still returns ``logits`` beside the loss. Computing them would undo the saving, so
under this option the logits output is an expanded NaN scalar of the logits' shape and dtype
(no memory): code that reads ``outputs.logits`` while training with ``tiled_loss`` reads NaN,
never a silently wrong number. Evaluation and generation run uncompiled (or with the option off)
and see real logits.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from deepcompile import ops
from deepcompile.passes import tiled_loss_kernels  # noqa: F401  (registers the kernels)
from deepcompile.passes.tiled_pass import TiledPass
from deepcompile.passes.tiling_choice import TilingChoice

_LINEAR = (F.linear,)  # torch._C._nn.linear itself: Dynamo records that object
_CROSS_ENTROPY = (F.cross_entropy,)
_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
# Per-element steps between the LM head and the loss that keep one row per token.
_PASS_THROUGH_METHODS = ("float", "view", "reshape", "contiguous", "to")
# Bytes of fp32 logits one chunk may hold when compile.tiled_loss_chunk_tokens is 0 (auto).
AUTO_CHUNK_BYTES = 256 * 1024 * 1024


def chunk_tokens(vocab: int, configured: int) -> int:
    """Tokens per chunk: ``configured``, or (0) as many as fit AUTO_CHUNK_BYTES of fp32 logits."""
    return configured if configured > 0 else max(1, AUTO_CHUNK_BYTES // (4 * vocab))


def _ce_argument(node: Node, name: str, default=None):
    i = _CE_ARGS.index(name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _example(node: Node) -> Optional[torch.Tensor]:
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _lm_head_of(logits: Node) -> Optional[Node]:
    """The ``linear`` call whose output reaches ``logits`` through per-element steps only."""
    node = logits
    while isinstance(node, Node):
        if node.op == "call_function" and node.target in _LINEAR:
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            return node if bias is None else None
        if node.op == "call_method" and node.target in _PASS_THROUGH_METHODS:
            node = node.args[0]
            continue
        return None
    return None


def _steps_between(head: Node, scores: Node) -> List[Node]:
    """The per-element steps from ``scores`` back to (not including) ``head``, last first."""
    steps, node = [], scores
    while node is not head:
        steps.append(node)
        node = node.args[0]
    return steps


def find_losses(gm: GraphModule) -> List[Tuple[Node, Node]]:
    """(cross_entropy node, its LM-head linear node) for every loss the pass can tile."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CROSS_ENTROPY:
            continue
        if _ce_argument(node, "weight") is not None or _ce_argument(node, "label_smoothing", 0.0) not in (0, 0.0):
            continue
        if _ce_argument(node, "size_average") is not None or _ce_argument(node, "reduce") is not None:
            continue
        if _ce_argument(node, "reduction", "mean") not in ("mean", "sum"):
            continue
        scores, target = _ce_argument(node, "input"), _ce_argument(node, "target")
        head = _lm_head_of(scores)
        example, labels = _example(scores), _example(target)
        if head is None or example is None or labels is None or example.dim() != 2 or labels.dim() != 1:
            continue
        found.append((node, head))
    return found


def _nan_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the model returns as logits under tiled_loss: NaN, the logits' shape and dtype, no memory."""
    return hidden.new_full((), float("nan")).expand(*hidden.shape[:-1], weight.shape[0])


def held_bytes(head: Node) -> int:
    """What the untiled loss holds at once: the logits in their dtype, their fp32 upcast and the
    fp32 values the loss saves for its gradient (from the traced shape)."""
    example = _example(head)
    if example is None:
        return 0
    return example.numel() * (example.element_size() + 8)


def tile_losses(gm: GraphModule, configured_chunk: int, choice: TilingChoice = None) -> int:
    """Replace the tileable losses of ``gm`` that ``choice`` wants (default: all; see the module's
    doc); returns how many."""
    choice = choice if choice is not None else TilingChoice(True)
    graph = gm.graph
    losses = [(ce, head) for ce, head in find_losses(gm) if choice.wants(held_bytes(head))]
    for ce, head in losses:
        hidden, weight = head.args[0], head.args[1]
        vocab = _example(weight).shape[0] if _example(weight) is not None else _example(head).shape[-1]
        features = _example(hidden).shape[-1]
        with graph.inserting_before(ce):
            flat = graph.call_method("reshape", (hidden, -1, features))
            tiled = graph.call_function(ops.LINEAR_CROSS_ENTROPY, (
                flat, weight, _ce_argument(ce, "target"), int(_ce_argument(ce, "ignore_index", -100)),
                str(_ce_argument(ce, "reduction", "mean")), chunk_tokens(vocab, configured_chunk)))
        tiled.meta.update(ce.meta)
        chain = _steps_between(head, _ce_argument(ce, "input"))
        ce.replace_all_uses_with(tiled)
        graph.erase_node(ce)
        for step in chain:  # the upcast and flatten of the logits, now unread
            if not step.users:
                graph.erase_node(step)
        # The logits' other readers (the model's returned logits) get the NaN stand-in.
        others = [u for u in head.users]
        if others:
            with graph.inserting_after(head):
                stand_in = graph.call_function(_nan_logits, (hidden, weight))
            stand_in.meta.update(head.meta)
            head.replace_all_uses_with(stand_in, delete_user_cb=lambda user: user is not stand_in)
        if not head.users:
            graph.erase_node(head)
    if losses:
        graph.lint()
        gm.recompile()
    return len(losses)


class TiledLoss(TiledPass):
    """``compile.tiled_loss``'s pass (passes/tiled_pass.py) with this module's ``tile_losses``."""

    def __init__(self, configured_chunk: int, choice: TilingChoice = None):
        super().__init__(tile_losses, configured_chunk, choice)
