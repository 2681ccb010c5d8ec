"""Plain causal attention where transformers traced a materialised causal mask.

Under ``torch.compile`` transformers cannot look at the positions to see that a batch is not
packed (``find_packed_sequence_indices`` gives up while tracing), so a whole-model graph always
builds the ``[B, 1, S, S]`` mask and hands it to ``scaled_dot_product_attention``. Eagerly it would
have passed no mask and ``is_causal=True``. The mask costs ``S^2`` elements (32 GiB in bf16 at 131k
tokens, 128 GiB at 262k) and keeps SDPA off its flash kernels, which take no mask.

When the mask cannot depend on the data, it is the causal mask, and the pass gives the attention
call ``is_causal=True`` without it (Inductor then drops the mask's computation, no longer used):

* the mask's inputs are shapes and constants only, no tensor the forward was called with (no
  ``attention_mask``, no ``position_ids``: called with either, Dynamo traces another graph, whose
  mask is left alone, so padded and packed batches keep their masks);
* the model's attention is causal and its configuration asks for no other kind of mask
  (:func:`masks_are_causal`: every attention module's ``is_causal``, no sliding window, no chunked
  attention);
* the call attends from and to the same tokens (no KV cache), without ``is_causal`` set already.

With ``compile.packed_sequences`` (``documents_key``), a mask that depends on the forward's
``position_ids`` and no other input is transformers' packed-sequence mask: the call becomes
``dcsp::packed_attention`` over the documents the engine publishes each forward
(sequence_parallel/documents.py, packed_attention.py), so packed rows cost no ``S^2`` mask either.

Masks passed into activation-checkpointed layers (a higher-order op's subgraph) are followed to the
outer graph through the op's operands. Per-layer graphs (``regional``) see the mask as a layer input
and are left alone; there the eager model code already passes none for unpacked batches.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from deepcompile import compat, ops

_SDPA = F.scaled_dot_product_attention  # read at import, before any engine wraps it (sequence_parallel/eager_guard.py)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# Calls that read a tensor's shape, not its values: the traversal does not follow their tensor.
_SHAPE_READS = {"size", "dim"}


def masks_are_causal(model: torch.nn.Module) -> bool:
    """Whether the model's attention is plain causal attention when unpacked and unpadded: every
    attention module says ``is_causal`` (transformers' flag; an encoder's is False, and an all-true
    mask traced for it must stay bidirectional), and the outermost configuration asks for no sliding
    window and no chunked attention."""
    flags = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if not flags or not all(flags):
        return False  # an encoder, a mix, or nothing that says what its attention is
    for _, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            continue
        return not uses_sliding_window(config) and not getattr(config, "attention_chunk_size", None)
    return False


def uses_sliding_window(config: Any) -> bool:
    """Mistral's default, Gemma's and Qwen2's sliding layers (``layer_types`` or ``sliding_window``)."""
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    return any("sliding" in str(t) for t in layer_types) or bool(
        not layer_types and window and getattr(config, "use_sliding_window", True) is not False)


def sdpa_argument(node: Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a ``scaled_dot_product_attention`` call, positional or keyword."""
    index = _SDPA_ARGS.index(name)
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def set_sdpa_argument(node: Node, name: str, value: Any) -> None:
    """Set argument ``name`` of a ``scaled_dot_product_attention`` call where the call passes it."""
    index = _SDPA_ARGS.index(name)
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _reads_shape_only(node: Node) -> bool:
    return (node.op == "call_method" and node.target in _SHAPE_READS) or (
        node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] == "shape") or (
        node.op == "call_function" and node.target is torch.ops.aten.sym_size.int)


def _tensor_inputs(node: Node) -> Set[str]:
    """The tensor placeholders ``node``'s value depends on through more than a shape read (empty:
    it follows from shapes and constants alone; symbolic sizes, non-tensor placeholders, are fine)."""
    found: Set[str] = set()
    seen: Set[Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if isinstance(current.meta.get("example_value"), torch.Tensor):
                found.add(current.name)
            continue
        if _reads_shape_only(current):
            continue
        stack.extend(current.all_input_nodes)
    return found


def _data_independent(node: Node) -> bool:
    return not _tensor_inputs(node)


def _positions_only(node: Node) -> bool:
    """Whether the mask depends on the forward's ``position_ids`` and nothing else of its inputs
    (transformers' packed-sequence mask: no padding ``attention_mask``, no token types)."""
    inputs = _tensor_inputs(node)
    return bool(inputs) and all("position_ids" in name for name in inputs)


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _call_with_example(graph: torch.fx.Graph, target: Any, args: tuple, example: Any) -> Node:
    node = graph.call_function(target, args)
    if example is not None:
        node.meta["example_value"] = example
    return node


def packed_attention_call(graph: torch.fx.Graph, scale: Any, q: Node, k: Node, v: Node, key: int) -> Node:
    """Nodes computing ``dcsp::packed_attention`` of ``q``, ``k``, ``v`` with the documents published
    under ``key`` (``dcsp::documents``), inserted where the graph's insertion point is; returns
    the node of the attention's output. Shared with the sequence-parallel pass."""
    import operator

    examples = [_example(x) for x in (q, k, v)]
    docs_example = out_example = None
    if all(isinstance(e, torch.Tensor) for e in examples):
        docs_example = ops._fake_documents(examples[0], key)
        out_example = ops._fake_attention(*examples, *docs_example, None)
    docs = _call_with_example(graph, ops.DOCUMENTS, (q, key), docs_example)
    parts = [_call_with_example(graph, operator.getitem, (docs, i), None if docs_example is None else docs_example[i])
             for i in range(3)]
    attention = _call_with_example(graph, ops.PACKED_ATTENTION, (q, k, v, *parts, scale), out_example)
    return _call_with_example(graph, operator.getitem, (attention, 0), None if out_example is None else out_example[0])


def _subgraph_operands(gm: GraphModule) -> Dict[str, Tuple[Node, int]]:
    """For each higher-order op call of ``gm`` whose first argument is a subgraph: the subgraph's
    name, the call, and the index of the call's argument that feeds the subgraph's first input."""
    found: Dict[str, Tuple[Node, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not compat.is_higher_order_op(node.target):
            continue
        if node.args and isinstance(node.args[0], Node) and node.args[0].op == "get_attr":
            found[node.args[0].target] = (node, 1)
    return found


def _outer_source(value: Any, graph_name: Optional[str], operands: Dict[str, Tuple[Node, int]]) -> Optional[Node]:
    """The node of the outer graph that ``value`` (a node of subgraph ``graph_name``, or of the
    outer graph when None) stands for."""
    if not isinstance(value, Node):
        return None
    if graph_name is None:
        return value
    if value.op != "placeholder" or graph_name not in operands:
        return None
    call, first = operands[graph_name]
    position = [n for n in value.graph.nodes if n.op == "placeholder"].index(value)
    index = first + position
    return call.args[index] if index < len(call.args) and isinstance(call.args[index], Node) else None


def _same_length(node: Node) -> bool:
    query, key = (sdpa_argument(node, name) for name in ("query", "key"))
    shapes = [n.meta.get("example_value") if isinstance(n, Node) else None for n in (query, key)]
    return all(isinstance(s, torch.Tensor) and s.dim() == 4 for s in shapes) and shapes[0].shape[-2] == \
        shapes[1].shape[-2]


def _packable(node: Node) -> bool:
    dropout, scale = sdpa_argument(node, "dropout_p", 0.0), sdpa_argument(node, "scale")
    return not isinstance(dropout, Node) and not dropout and not isinstance(scale, Node)


def elide_causal_masks(gm: GraphModule, documents_key: Optional[int] = None) -> Tuple[int, int]:
    """Give every attention call of ``gm`` (and of its checkpointed subgraphs) whose mask is
    data-independent ``is_causal=True`` instead of the mask (see the module's doc). With
    ``documents_key`` (``compile.packed_sequences``), a call whose mask depends on the forward's
    ``position_ids`` alone becomes ``dcsp::packed_attention`` over the documents the engine
    publishes under that key. Returns the calls elided and the calls made packed. The caller
    decides whether the model's masks are causal at all."""
    operands = _subgraph_operands(gm)
    graphs: List[Tuple[Optional[str], GraphModule]] = [(None, gm)] + [
        (name, module) for name, module in gm.named_modules() if name and isinstance(module, GraphModule)]
    elided = packed = 0
    for name, module in graphs:
        edited = False
        for node in list(module.graph.nodes):
            if node.op != "call_function" or node.target is not _SDPA:
                continue
            mask = sdpa_argument(node, "attn_mask")
            if mask is None or sdpa_argument(node, "is_causal", False) or not _same_length(node):
                continue
            source = _outer_source(mask, name, operands)
            if source is None:
                continue
            if _data_independent(source):
                set_sdpa_argument(node, "attn_mask", None)
                set_sdpa_argument(node, "is_causal", True)
                elided += 1
            elif documents_key is not None and _positions_only(source) and _packable(node):
                with module.graph.inserting_before(node):
                    out = packed_attention_call(module.graph, sdpa_argument(node, "scale"),
                                                *(sdpa_argument(node, n) for n in ("query", "key", "value")), documents_key)
                node.replace_all_uses_with(out)
                module.graph.erase_node(node)
                packed += 1
            else:
                continue
            edited = True
        if edited:
            module.graph.lint()
            module.recompile()
    return elided, packed


class CausalMaskElision:
    """The engine's instance of the pass (a captured-graph pass): how many calls it changed so far.
    ``documents_key``: compile.packed_sequences without sequence parallelism (the engine publishes
    each forward's documents under it)."""

    def __init__(self, documents_key: Optional[int] = None) -> None:
        self.documents_key = documents_key
        self.elided = 0
        self.packed = 0

    def rewrite(self, gm: GraphModule) -> int:
        elided, packed = elide_causal_masks(gm, self.documents_key)
        self.elided += elided
        self.packed += packed
        return elided + packed
