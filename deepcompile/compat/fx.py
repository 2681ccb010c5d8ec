"""FX and the op registry: what the graph passes need to know about an operator and a node
beyond FX's public API, and the pytree helpers torch keeps private."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree


def tree_leaves(tree: Any) -> List[Any]:
    """The leaves of a nested structure of tuples, lists and dicts (``torch.utils._pytree``)."""
    return pytree.tree_leaves(tree)


def tree_map_only(kind: type, fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf of type ``kind`` replaced by ``fn(leaf)`` (``torch.utils._pytree``)."""
    return pytree.tree_map_only(kind, fn, tree)


def node_position(node: Node) -> Any:
    """A key ordering the nodes of one graph as the graph does (kept up to date by FX when
    nodes are inserted or moved), so "which comes first" costs no walk over the graph.

    Relies on ``Node._sort_key`` (torch >= 2.5).
    """
    return node._sort_key


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule over ``graph`` whose Python code is generated only when it is first called or
    its code read. Most graph copies here are only read (planning) or interpreted node by node (the
    profiler); generating code for each of them cost a second per warm start of a 16-layer model
    compiled per layer (bench/compile_time.py). Uses ``torch.fx._lazy_graph_module``, what Dynamo
    itself builds its graphs with (torch >= 2.3)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def mark_ops_side_effectful(ops: Iterable[Any]) -> None:
    """Keep ``ops`` (operator overloads that return nothing useful) alive through dead-code removal.

    Uses ``torch.fx.node.has_side_effect``, which FX's ``Node.is_impure`` and Inductor's
    ``FallbackKernel.has_side_effects`` (through ``torch._library.utils.is_impure``) consult.
    Unlike DeepSpeed we do not switch off Inductor's dead-node elimination globally. The caller
    names the ops (``deepcompile/ops.py``, ``SIDE_EFFECTFUL``): compat knows
    torch, not which ops the package defines.
    """
    from torch.fx.node import has_side_effect

    for op in ops:
        has_side_effect(op)


def is_op_overload(target: Any) -> bool:
    """True if a node's target is one overload of a registered operator (``aten.mm.default``)
    rather than a Python callable. Relies on ``torch._ops.OpOverload``."""
    return isinstance(target, torch._ops.OpOverload)


def is_higher_order_op(target: Any) -> bool:
    """Whether an FX call target is a higher-order operator (activation checkpointing's
    ``tag_activation_checkpoint``, ``wrap``): its first argument names a subgraph."""
    return isinstance(target, torch._ops.HigherOrderOperator)


def operator_namespace(target: Any) -> Optional[str]:
    """The namespace of a registered operator a node calls (``"aten"``, ``"transformers"``), as
    an overload or as its packet (Dynamo's graphs call packets); None for Python callables.
    Relies on ``OpOverload.namespace`` and ``OpOverloadPacket._qualified_op_name``."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0]
    return None


def overload_packet_name(op: Any) -> str:
    """The operator's name without namespace and overload: ``"mm"`` for ``aten.mm.default``.
    Relies on ``OpOverload._overloadpacket``."""
    return op._overloadpacket.__name__


def returns_view_of_input(op: Any) -> bool:
    """True if the operator's schema says a result aliases an input without writing it (a view).
    Relies on ``OpOverload._schema`` and its ``alias_info``."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def eager_input_vals(node: Node) -> Optional[Tuple[tuple, Dict[str, Any]]]:
    """The fake values ``(args, kwargs)`` torch recorded for a stride-sensitive operator's inputs
    at trace time (``node.meta["eager_input_vals"]``); Inductor makes those inputs match them.
    None when nothing was recorded."""
    return node.meta.get("eager_input_vals")


def set_eager_input_vals(node: Node, args: tuple, kwargs: Dict[str, Any]) -> None:
    """Replace the recorded input values of ``node`` (see :func:`eager_input_vals`)."""
    node.meta["eager_input_vals"] = (args, kwargs)
