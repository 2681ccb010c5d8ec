"""The ZeRO-3 pass: gather parameters just before their first use and free them after the last.

Forward and backward graphs get, for every partitioned parameter placeholder with users:

    ag   = dc.allgather_param(param, graph_id, ds_id, dtype)   # before the first use
    full = dc.wait_allgather(ag, graph_id, ds_id)               # every use now reads `full`
    ...
    out  = dc.release_param(last_use_output, graph_id, ds_id, 1)  # after the last use

The release takes the last user's output, so data dependencies (not only node order) keep it
after that use. Inductor fuses no generated kernel across these ops, so they sit at library calls
(matrix products, attention): the gather goes right after the library call before the first use,
and a release whose last use is pointwise (an RMSNorm weight) takes the output of the first
library call that reads that use's result. Otherwise every norm would be split from the residual
add before it, and its backward into three kernels. When the only use is a cast to a narrower
dtype (what autocast emits), the cast is fused into the gather.

Backward graphs of every stage also get their gradient reductions (``passes/reduce.py``), inserted
before this pass runs on them.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
from torch.fx import GraphModule, Node

from deepcompile import compat, ops
from deepcompile.passes.graph_utils import (
    alias_closure,
    first_library_call_reading,
    first_user,
    gather_point,
    is_alias_op,
    is_cast_op,
    is_library_call,
    last_user,
    reaches_output,
    refresh_layouts,
    tensor_result,
)

log = logging.getLogger(__name__)


def _fused_cast_dtype(param: Node) -> Optional[torch.dtype]:
    """The dtype to gather in, if the parameter's only use is a cast to a narrower float type."""
    users = [u for u in param.users if u.op != "output"]
    if len(users) != 1 or not is_cast_op(users[0]):
        return None
    cast = users[0]
    dtype = cast.args[1] if cast.target is torch.ops.prims.convert_element_type.default else cast.kwargs.get("dtype")
    if cast.target is torch.ops.aten._to_copy.default and set(cast.kwargs) - {"dtype"}:
        return None
    src = param.meta["val"].dtype
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize < src.itemsize:
        return dtype
    return None


def _anchor_after(reader: Node) -> Optional[Node]:
    """The node whose output a release after ``reader`` takes: ``reader``'s own tensor result,
    or, when ``reader`` is pointwise, that of the first library call reading its result, if every
    kernel Inductor may recompute ``reader`` in runs before that call (:func:`_inline_region`)."""
    anchor = tensor_result(reader)
    if not is_library_call(reader):
        later = first_library_call_reading(reader)
        if later is not None and tensor_result(later) is not None:
            before = _ancestors_from(tensor_result(later), compat.node_position(reader))
            if _inline_region(reader) <= before:
                anchor = tensor_result(later)
    return anchor


def _stored(node: Node) -> bool:
    """True if a library call reads ``node``'s value, directly or through views."""
    return any(is_library_call(u) or (is_alias_op(u) and _stored(u)) for u in node.users)


def _inline_region(reader: Node) -> set:
    """The nodes whose generated kernels may recompute ``reader`` (a pointwise read of the
    gathered parameter) rather than load its result: its readers through generated code, up to
    values a library call reads, which Inductor writes to memory once.

    Inductor does not store a cheap pointwise result that several kernels read; each recomputes
    it from its inputs, the gathered parameter included. An embedding lookup read by the first
    RMSNorm and by the residual add after the attention was recomputed in the add's kernel,
    after a release anchored on the first projection: it read freed storage (a segfault on the
    CPU, Trainer + PEFT LoRA under Inductor). A release anchored on the reader's own result makes
    Inductor store it; that costs a kernel split only where such a late reader exists."""
    region, stack = set(), [reader]
    while stack:
        node = stack.pop()
        if _stored(node):
            continue  # written to memory for a library call: later readers load it
        for user in node.users:
            if user.op != "output" and not is_library_call(user) and user not in region:
                region.add(user)
                stack.append(user)
    return region


def _readers(aliases) -> List[Node]:
    return list(dict.fromkeys(u for v in aliases for u in v.users if u.op != "output" and u not in aliases))


def _release_anchors(graph, aliases, full: Node) -> List[Node]:
    """Anchors of the releases of one gather episode, each release taking its anchor's output.

    Usually one: after the last reader in graph order, whose result depends on every other
    reader's. But Inductor orders nodes by data dependencies only, and fuses across graph order:
    in a backward that recomputes a checkpointed region, the recomputation reads the weight and
    the input gradient reads it again, neither depending on the other. A kernel fusing the
    recomputed ``tanh`` with the ``tanh`` backward moved the recomputed product after a release
    anchored on the input gradient: it read freed storage. So every reader that the release's
    anchor does not depend on gets a release of its own; the runtime frees the buffer when the
    last of the episode's ``n_users`` releases has run, whichever order they run in.
    """
    position = compat.node_position
    readers = _readers(aliases)
    if not readers:  # an alias nobody reads still needs the buffer until it is created
        return [tensor_result(last_user(graph, aliases)) or full]
    earliest = min(position(r) for r in readers)
    uncovered = sorted(readers, key=position)
    anchors: List[Node] = []
    while uncovered:
        reader = uncovered.pop()
        anchor = _anchor_after(reader)
        if anchor is None:
            if anchors:
                continue  # no tensor to hang a release on: graph order keeps it before the others
            anchor = full
        anchors.append(anchor)
        reached = _ancestors_from(anchor, earliest)
        uncovered = [r for r in uncovered if r not in reached]
    return anchors


def _ancestors_from(node: Node, earliest) -> set:
    """``node`` and the nodes it depends on, down to graph position ``earliest`` (a
    ``compat.node_position``; graph order is a topological order: no earlier node can depend on
    a reader)."""
    position = compat.node_position
    seen = {node}
    stack = [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen and position(arg) >= earliest:
                seen.add(arg)
                stack.append(arg)
    return seen


def insert_gather_release(gm: GraphModule, graph_id: int, params: Dict[Node, int]) -> int:
    """Insert gather/wait/release around every parameter placeholder in ``params``.

    Returns the number of parameters that could not be released because a gathered alias is an
    output of the graph (it then stays gathered until the next release of another episode).
    """
    graph = gm.graph
    kept = 0
    gathered_values: List[Node] = []
    for param, ds_id in params.items():
        first = first_user(graph, param)
        if first is None:
            continue
        dtype = _fused_cast_dtype(param)
        cast = first if dtype is not None else None
        with graph.inserting_before(gather_point(first)):
            # Always a named dtype (the parameter's own when no cast is fused): the op's fake kernel
            # then needs nothing from the live runtime.
            gather_dtype = dtype if dtype is not None else param.meta["val"].dtype
            gathered = graph.call_function(ops.ALLGATHER_PARAM, (param, graph_id, ds_id), {"dtype": gather_dtype})
            full = graph.call_function(ops.WAIT_ALLGATHER, (gathered, graph_id, ds_id))
        # What the gather returns: contiguous, unlike the stride-0 placeholder that was traced.
        traced = param.meta["val"]
        gathered.meta["val"] = traced.new_empty(traced.shape, dtype=dtype or traced.dtype)
        full.meta["val"] = gathered.meta["val"]
        gathered_values.append(full)
        if cast is not None:
            cast.replace_all_uses_with(full)
            graph.erase_node(cast)
        else:
            for user in [u for u in param.users if u.op != "output" and u is not gathered]:
                user.replace_input_with(param, full)

        aliases = alias_closure(full)
        if reaches_output(aliases):
            # A gathered alias escapes the graph: freeing it would corrupt the escaped value.
            log.warning("deepcompile: graph %d returns a view of gathered parameter %d; it is not released", graph_id, ds_id)
            kept += 1
            continue
        anchors = _release_anchors(graph, aliases, full)
        for anchor in anchors:
            with graph.inserting_after(anchor):
                released = graph.call_function(ops.RELEASE_PARAM, (anchor, graph_id, ds_id, len(anchors)))
            released.meta["val"] = anchor.meta.get("val")
            anchor.replace_all_uses_with(released, delete_user_cb=lambda u, r=released: u is not r)
    refresh_layouts(graph, gathered_values)
    graph.lint()
    return kept
