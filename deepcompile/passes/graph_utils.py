"""Small FX helpers shared by the passes: alias tracking and last-use analysis."""

from __future__ import annotations

import operator
from typing import Iterable, Optional, Set

import torch
from torch.fx import Graph, Node

from deepcompile import compat, ops


def is_alias_op(node: Node) -> bool:
    """True if ``node`` returns a view of (one of) its inputs: its users read the same storage."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in ops.ALIASING:
        return True
    return compat.is_op_overload(target) and compat.returns_view_of_input(target)


def is_cast_op(node: Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target in (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def alias_closure(root: Node) -> Set[Node]:
    """``root`` and every node that views it, transitively."""
    members = {root}
    stack = [root]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user not in members and is_alias_op(user) and user.args and user.args[0] in members:
                members.add(user)
                stack.append(user)
    return members


def last_user(graph: Graph, values: Set[Node]) -> Optional[Node]:
    """The last non-output node (in graph order) that reads any of ``values``."""
    readers = [u for v in values for u in v.users if u.op != "output" and u not in values]
    if readers:
        return max(readers, key=compat.node_position)
    # An alias that nobody reads still needs the buffer until it is created.
    return max(values, key=compat.node_position) if values else None


def reaches_output(values: Iterable[Node]) -> bool:
    return any(user.op == "output" for v in values for user in v.users)


def first_user(graph: Graph, node: Node) -> Optional[Node]:
    users = [u for u in node.users if u.op != "output"]
    return min(users, key=compat.node_position) if users else None


# Operators Inductor runs as library calls (cuBLAS, attention kernels, custom ops) rather than
# generating code for: their outputs are buffers in any case, so anchoring a runtime op on one
# costs no fusion. Anchoring one on a pointwise result instead forces that result into memory and
# splits the generated kernel around it (e.g. an RMSNorm from the residual add before it).
_LIBRARY_CALL_PACKETS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")
_LIBRARY_CALL_PREFIXES = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention")


def is_library_call(node: Node) -> bool:
    """True if Inductor runs ``node`` as a library call whose output it materializes anyway."""
    if node.op != "call_function" or not compat.is_op_overload(node.target):
        return False
    namespace = node.target.namespace
    if namespace == "prims":
        return False  # lowered into generated code
    if namespace != "aten":
        return True  # custom ops are fallback kernels
    name = compat.overload_packet_name(node.target)
    return name in _LIBRARY_CALL_PACKETS or name.startswith(_LIBRARY_CALL_PREFIXES)


def _nodes_after(node: Node):
    n = node.next
    while n.op != "root":
        yield n
        n = n.next


def first_library_call_reading(node: Node) -> Optional[Node]:
    """The first library call after ``node`` in graph order that reads ``node``'s result
    (transitively): it runs after ``node`` and after everything ``node`` depends on."""
    descendants = {node}
    for n in _nodes_after(node):
        if n.op == "output":
            break
        if any(a in descendants for a in n.all_input_nodes):
            descendants.add(n)
            if is_library_call(n):
                return n
    return None


def gather_point(node: Node) -> Node:
    """Where to start gathering a parameter first read by ``node``: right after the library call
    (or last placeholder) before it, rather than right before ``node``. Ops between the gather and
    the wait do not depend on them, but Inductor does not fuse generated kernels across these
    fallback calls, so a wait right before ``node`` would split the pointwise region ``node`` is
    part of (e.g. a residual add from the RMSNorm after it)."""
    point = node
    while point.prev.op != "root" and point.prev.op != "placeholder" and not is_library_call(point.prev):
        point = point.prev
    return point


def tensor_result(node: Node) -> Optional[Node]:
    """A node holding a tensor produced by ``node``: itself, or its first getitem for tuples."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return node
    if isinstance(val, (tuple, list)):
        for user in node.users:
            if user.op == "call_function" and user.target is operator.getitem:
                if isinstance(user.meta.get("val"), torch.Tensor):
                    return user
    return None


def _layout(value) -> Optional[tuple]:
    """Sizes, strides and dtypes of every tensor in ``value``, as text: symbolic sizes compare by
    expression without adding guards."""
    leaves = [v for v in compat.tree_leaves(value) if isinstance(v, torch.Tensor)]
    if not leaves:
        return None
    return tuple((tuple(map(str, t.shape)), tuple(map(str, t.stride())), t.dtype) for t in leaves)


def _creates_symbols(target) -> bool:
    """Ops whose output sizes depend on data: re-running them on fake tensors would mint new
    unbacked symbols the graph does not bind."""
    tags = getattr(target, "tags", ())
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def refresh_layouts(graph: Graph, changed: Iterable[Node]) -> int:
    """Recompute the fake value (``meta["val"]``) of every node whose input layout changed.

    The ZeRO-3 pass replaces a parameter input, traced as a stride-0 placeholder, by a contiguous
    gathered tensor. Nodes derived from it (``permute(weight)`` ...) still carry the placeholder's
    strides, and Inductor reads those: a fallback or custom op (e.g. transformers' grouped-mm
    expert kernel) gets its argument copied into the traced layout, a stride-0 tensor of one
    element. Values are recomputed in graph order from the inputs' updated values, and only where
    the layout differs is the new value kept (the old one, and its symbols, stay otherwise).
    Operators that need their inputs' exact strides (custom ops by default) get their recorded
    eager inputs (``meta["eager_input_vals"]``, which Inductor constrains those inputs to) updated
    the same way. Returns the number of nodes whose value was updated.
    """
    changed = set(changed)
    updated = 0
    for node in graph.nodes:
        if node in changed or node.op != "call_function" or not compat.is_op_overload(node.target):
            continue
        if not any(a in changed for a in node.all_input_nodes):
            continue
        _refresh_eager_input_vals(node, changed)
        if _creates_symbols(node.target):
            continue
        if any("val" not in a.meta for a in node.all_input_nodes):
            continue
        args, kwargs = compat.tree_map_only(Node, lambda n: n.meta["val"], (node.args, node.kwargs))
        try:
            value = node.target(*args, **kwargs)  # fake inputs: runs the op's fake/meta kernel
        except Exception:  # an op without a fake kernel for these inputs keeps its traced value
            continue
        if _layout(value) != _layout(node.meta.get("val")):
            node.meta["val"] = value
            changed.add(node)
            updated += 1
    return updated


def _refresh_eager_input_vals(node: Node, changed: Set[Node]) -> None:
    """Point the eager input values recorded for ``node`` at the current values of its changed
    inputs. They were recorded from ``node``'s arguments at trace time, position for position."""
    recorded = compat.eager_input_vals(node)
    if recorded is None:
        return
    old_args, old_kwargs = recorded
    if len(old_args) != len(node.args) or set(old_kwargs) != set(node.kwargs):
        return  # rewritten since it was traced: leave Inductor's constraint as it is

    def current(arg, old):
        return arg.meta["val"] if isinstance(arg, Node) and arg in changed else old

    compat.set_eager_input_vals(
        node,
        tuple(current(a, o) for a, o in zip(node.args, old_args)),
        {k: current(v, old_kwargs[k]) for k, v in node.kwargs.items()},
    )
