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

Masks passed into activation-checkpointed layers (a higher-order op's subgraph) are followed to the
outer graph through the op's operands. Per-layer graphs (``regional``) see the mask as a layer input
and are left alone; there the eager model code already passes none for unpacked batches.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from deepcompile import compat

_SDPA = F.scaled_dot_product_attention
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


def _argument(node: Node, name: str, default: Any = None) -> Any:
    index = _SDPA_ARGS.index(name)
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _set_argument(node: Node, name: str, value: Any) -> None:
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


def _data_independent(node: Node) -> bool:
    """Whether ``node``'s value follows from shapes and constants alone: no tensor placeholder is
    reached through anything but a shape read. Symbolic sizes (non-tensor placeholders) are fine."""
    seen: Set[Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if isinstance(current.meta.get("example_value"), torch.Tensor):
                return False
            continue
        if _reads_shape_only(current):
            continue
        stack.extend(current.all_input_nodes)
    return True


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
    query, key = (_argument(node, name) for name in ("query", "key"))
    shapes = [n.meta.get("example_value") if isinstance(n, Node) else None for n in (query, key)]
    return all(isinstance(s, torch.Tensor) and s.dim() == 4 for s in shapes) and shapes[0].shape[-2] == \
        shapes[1].shape[-2]


def elide_causal_masks(gm: GraphModule) -> int:
    """Give every attention call of ``gm`` (and of its checkpointed subgraphs) whose mask is
    data-independent ``is_causal=True`` instead of the mask (see the module's doc); returns how
    many calls changed. The caller decides whether the model's masks are causal at all."""
    operands = _subgraph_operands(gm)
    graphs: List[Tuple[Optional[str], GraphModule]] = [(None, gm)] + [
        (name, module) for name, module in gm.named_modules() if name and isinstance(module, GraphModule)]
    changed = 0
    for name, module in graphs:
        edited = False
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target is not _SDPA:
                continue
            mask = _argument(node, "attn_mask")
            if mask is None or _argument(node, "is_causal", False) or not _same_length(node):
                continue
            source = _outer_source(mask, name, operands)
            if source is None or not _data_independent(source):
                continue
            _set_argument(node, "attn_mask", None)
            _set_argument(node, "is_causal", True)
            edited = True
            changed += 1
        if edited:
            module.graph.lint()
            module.recompile()
    return changed


class CausalMaskElision:
    """The engine's instance of the pass (a captured-graph pass): how many calls it changed so far."""

    def __init__(self) -> None:
        self.elided = 0

    def rewrite(self, gm: GraphModule) -> int:
        count = elide_causal_masks(gm)
        self.elided += count
        return count
