"""The Ulysses graph pass: attention over the whole sequence from sequence slices.

It runs on the graph Dynamo captured, before aot_autograd, so that the backward of what it inserts
is traced with the rest (the all-to-all's adjoint is the inverse all-to-all, deepcompile/ops.py).
Each rank holds a contiguous slice of ``S / P`` tokens of every sequence. For each call of
``torch.nn.functional.scaled_dot_product_attention`` with ``query`` ``[B, H, S / P, D]``:

* ``query``, ``key`` and ``value`` go through an all-to-all that trades sequence for heads: the
  rank ends up with ``H / P`` heads over all ``S`` tokens, the slices concatenated in rank order
  (which is sequence order, sequence_parallel/groups.py);
* attention runs unchanged on that: causal masking (``is_causal``) and the softmax see the whole
  sequence, so every token attends to exactly the tokens it would in one process;
* the output goes through the inverse all-to-all, back to all heads over the rank's slice.

Everything outside attention is per token and needs no change, provided the positions are the
global ones: the batch carries ``position_ids`` of the slice (sequence_parallel/batch.py), so
rotary embeddings stay right.

Grouped-query attention: ``key``/``value`` heads are split over the ranks as well. When their
count does not divide by ``P`` (fewer KV heads than ranks, say), they are repeated to the least
common multiple of the two first, which keeps each query head paired with its own KV head.

Masks: a mask the model materialised was built for the local slice only. Traced, transformers
builds one from ``position_ids`` whenever no cache is used (it cannot look at the positions to see
that the sequences are not packed). The pass drops it and attends with ``is_causal=True`` over the
whole sequence, which is the same mask for unpacked sequences; the engine checks every batch's
inputs for exactly that case before the forward (``SequenceParallel.check_inputs``): no padding
``attention_mask`` and global, consecutive ``position_ids``. Packed sequences are refused there, unless ``compile.packed_sequences`` is on:
then the pass calls ``dcsp::packed_attention`` instead of SDPA, with the forward's documents from
``dcsp::documents`` (sequence_parallel/documents.py, packed_attention.py), which keeps attention
inside each document of a packed row and is plain causal attention for unpacked ones.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from deepcompile import ops
from deepcompile.passes.causal_mask import packed_attention_call, sdpa_argument, set_sdpa_argument

_SDPA_TARGETS = (F.scaled_dot_product_attention,)  # read at import, before any engine wraps it (eager_guard.py)
_HEADS, _SEQUENCE = 1, 2


class SequenceParallelError(ValueError):
    """A model the Ulysses pass cannot make sequence parallel, and why."""


def _shape(value: Any) -> Optional[torch.Size]:
    example = value.meta.get("example_value") if isinstance(value, Node) else None
    return example.shape if isinstance(example, torch.Tensor) else None


def _check_call(node: Node, ranks: int, packed: bool = False) -> Dict[str, int]:
    """The head counts of one attention call, or SequenceParallelError saying why it cannot be split."""
    where = f"attention call {node.name!r}"
    if packed:
        dropout, scale = sdpa_argument(node, "dropout_p", 0.0), sdpa_argument(node, "scale")
        if isinstance(dropout, Node) or dropout:
            raise SequenceParallelError(f"{where} uses attention dropout ({dropout}), which compile.packed_sequences "
                                        "does not support; set the model's attention dropout to 0")
        if isinstance(scale, Node):
            raise SequenceParallelError(f"{where} computes its softmax scale in the graph; compile.packed_sequences "
                                        "needs it constant")
    mask = sdpa_argument(node, "attn_mask")
    if mask is not None and sdpa_argument(node, "is_causal", False):
        raise SequenceParallelError(f"{where} takes both a mask and is_causal=True")
    shapes = [_shape(sdpa_argument(node, name)) for name in ("query", "key", "value")]
    if any(s is None or len(s) != 4 for s in shapes):
        raise SequenceParallelError(f"{where}: query, key and value must be [batch, heads, sequence, head_dim] "
                                    f"tensors, got shapes {shapes}")
    heads, kv_heads = shapes[0][_HEADS], shapes[1][_HEADS]
    if heads % ranks:
        raise SequenceParallelError(f"{where}: {heads} attention heads do not split over sequence_parallel_size "
                                    f"{ranks}; choose a size that divides the head count")
    repeat = 1
    if kv_heads % ranks:
        if not sdpa_argument(node, "enable_gqa", False) and kv_heads != heads:
            raise SequenceParallelError(f"{where}: {kv_heads} key/value heads for {heads} query heads without "
                                        "enable_gqa")
        common = kv_heads * ranks // math.gcd(kv_heads, ranks)
        if heads % common:
            raise SequenceParallelError(
                f"{where}: {kv_heads} key/value heads cannot be spread over {ranks} ranks while keeping each of "
                f"the {heads} query heads with its key/value head; choose a sequence_parallel_size that divides "
                f"{kv_heads}, or one whose least common multiple with it divides {heads}")
        repeat = common // kv_heads
    return {"heads": heads, "kv_heads": kv_heads, "repeat": repeat, "drop_mask": mask is not None}


def _insert_all_to_all(graph: torch.fx.Graph, value: Node, scatter: int, gather: int, ranks: int,
                       group_key: int) -> Node:
    node = graph.call_function(ops.ALL_TO_ALL, (value, scatter, gather, ranks, group_key))
    example = value.meta.get("example_value")
    if isinstance(example, torch.Tensor):
        node.meta["example_value"] = example.new_empty(ops.all_to_all_shape(example.shape, scatter, gather, ranks))
    return node


def _repeat_heads(graph: torch.fx.Graph, value: Node, repeat: int) -> Node:
    node = graph.call_function(torch.repeat_interleave, (value, repeat), {"dim": _HEADS})
    example = value.meta.get("example_value")
    if isinstance(example, torch.Tensor):
        node.meta["example_value"] = torch.repeat_interleave(example, repeat, dim=_HEADS)
    return node


def _graphs(gm: GraphModule) -> List[GraphModule]:
    """``gm`` and the subgraphs of its higher-order ops (activation checkpointing traces each
    checkpointed region into a subgraph that ``tag_activation_checkpoint`` calls)."""
    return [m for _, m in gm.named_modules() if isinstance(m, GraphModule)]


def attention_calls(gm: GraphModule) -> List[Node]:
    return [n for g in _graphs(gm) for n in g.graph.nodes if n.op == "call_function" and n.target in _SDPA_TARGETS]


def split_attention(gm: GraphModule, ranks: int, group_key: int, packed: bool = False) -> int:
    """Make every attention call of ``gm`` and its subgraphs run over the whole sequence (see the
    module's doc); returns how many calls were rewritten. ``packed``: attention kept inside the
    documents of packed rows (``dcsp::packed_attention``). Raises SequenceParallelError before changing
    anything when one cannot be."""
    for node in attention_calls(gm):  # every check before the first edit
        _check_call(node, ranks, packed)
    return sum(_split_in(g, ranks, group_key, packed) for g in _graphs(gm))


def _split_in(gm: GraphModule, ranks: int, group_key: int, packed: bool = False) -> int:
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in _SDPA_TARGETS]
    for node in calls:
        plan = _check_call(node, ranks, packed)
        with graph.inserting_before(node):
            moved = []
            for name in ("query", "key", "value"):
                value = sdpa_argument(node, name)
                if name != "query" and plan["repeat"] > 1:
                    value = _repeat_heads(graph, value, plan["repeat"])
                moved.append(_insert_all_to_all(graph, value, _HEADS, _SEQUENCE, ranks, group_key))
        if packed:
            with graph.inserting_before(node):
                output = packed_attention_call(graph, sdpa_argument(node, "scale"), *moved, group_key)
                back = _insert_all_to_all(graph, output, _SEQUENCE, _HEADS, ranks, group_key)
            node.replace_all_uses_with(back)
            graph.erase_node(node)
            continue
        replaced = dict(zip(("query", "key", "value"), moved))
        if plan["drop_mask"]:  # the local mask, replaced by causal attention over the whole sequence
            replaced.update(attn_mask=None, is_causal=True)
        for name, value in replaced.items():
            set_sdpa_argument(node, name, value)
        with graph.inserting_after(node):
            back = _insert_all_to_all(graph, node, _SEQUENCE, _HEADS, ranks, group_key)
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        example = node.meta.get("example_value")
        if isinstance(example, torch.Tensor):  # the call now sees H / P heads over S tokens
            node.meta["example_value"] = example.new_empty(ops.all_to_all_shape(example.shape, _HEADS, _SEQUENCE,
                                                                                ranks))
    if calls:
        graph.lint()
        gm.recompile()
    return len(calls)
