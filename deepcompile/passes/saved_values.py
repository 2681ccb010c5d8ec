"""Which values a forward graph saves for its backward, and which of them own their memory.

aot_autograd's forward graph returns ``num_fwd_outputs`` values the caller sees (mutated inputs,
user outputs, intermediate bases), then the values saved for the backward; each saved value
becomes a backward placeholder of the same name. Freeing or offloading a saved value is safe only
if nothing else can read its memory. A saved value is *exclusive* when

* it is computed by the graph (not a forward input: parameters, the batch, buffers), by an
  operator that does not return a view of an input (so it does not share an input's storage);
* no view of it (transitively, by schema or by its traced value sharing the storage) is seen by
  the caller or saved as well: freeing it would empty those views too;
* it is saved once, and is not one of the caller's outputs.

The analysis reads the graph as the partitioner made it, so it holds for any inner compiler that
keeps the graph's aliasing (the FX executor and Inductor do: an output buffer Inductor lays out
inside a larger one, as ``cat`` does with its inputs, is caught at run time by the offload op,
which then keeps it, and ``free_tensors`` frees a whole storage, which the inner compiler only
shares between values the graph says alias).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set

import torch
from torch.fx import GraphModule, Node

from deepcompile import compat
from deepcompile.passes.graph_utils import alias_closure, is_alias_op


@dataclasses.dataclass(frozen=True)
class SavedValue:
    name: str  # the forward node's name, which is also the backward placeholder's
    exclusive: bool
    nbytes: Optional[int]  # None: symbolic size
    floating: bool
    device: Optional[torch.device]


def storage_closure(graph, node: Node) -> Set[Node]:
    """``node`` and every node of ``graph`` whose value may share its storage: the views by
    schema (``alias_closure``) and every node whose traced (fake) value aliases ``node``'s, which
    also catches views whose schema does not say so (``aten._unsafe_view``)."""
    members = alias_closure(node)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        for other in graph.nodes:
            v = other.meta.get("val")
            if other not in members and isinstance(v, torch.Tensor) and compat.shares_storage(v, val):
                members.add(other)
    return members


def _nbytes(val: torch.Tensor) -> Optional[int]:
    try:
        return int(val.numel()) * val.element_size()
    except (TypeError, RuntimeError):  # symbolic size
        return None


def saved_values(forward: GraphModule, num_fwd_outputs: Optional[int]) -> Dict[str, SavedValue]:
    """The tensors ``forward`` saves for its backward, by name (empty if unknown)."""
    if num_fwd_outputs is None:
        return {}
    outputs = list(forward.graph.output_node().args[0])
    visible = {o for o in outputs[:num_fwd_outputs] if isinstance(o, Node)}
    saved_list = [o for o in outputs[num_fwd_outputs:] if isinstance(o, Node)]
    counts: Dict[Node, int] = {}
    for o in saved_list:
        counts[o] = counts.get(o, 0) + 1
    result: Dict[str, SavedValue] = {}
    for node in counts:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # a saved symbolic int
        closure = storage_closure(forward.graph, node)
        others = (visible | set(counts)) - {node}
        exclusive = (
            node.op == "call_function"
            and not is_alias_op(node)
            and compat.operator_namespace(node.target) not in ("dc", "dcact")  # runtime-owned buffers
            and counts[node] == 1
            and node not in visible
            and not (closure & others)
            and not any(m.op == "placeholder" for m in closure)  # shares a forward input's storage
        )
        result[node.name] = SavedValue(node.name, exclusive, _nbytes(val), val.is_floating_point(), val.device)
    return result


def saved_placeholders(backward: GraphModule, saved: Dict[str, SavedValue]) -> List[Node]:
    """The backward's placeholders that are exclusive saved values of its forward."""
    return [n for n in backward.graph.nodes
            if n.op == "placeholder" and not compat.is_incoming_gradient(n)
            and n.name in saved and saved[n.name].exclusive]
