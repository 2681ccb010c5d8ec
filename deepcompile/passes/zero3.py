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
dtype (what autocast emits), the cast is fused into the gather. The backward graph additionally sends every parameter gradient to
dc.reduce_grad and returns None in its place, then ends with dc.end_backward, which depends on
every reduction so no compiler can hoist it above them. A weight gradient that arrives as the
transpose of a matrix product is recomputed as the product of the transposed operands, so the
reduction reads it contiguous.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
from torch.fx import GraphModule, Node

from deepcompile.passes.graph_utils import (
    alias_closure,
    first_library_call_reading,
    first_user,
    gather_point,
    is_cast_op,
    is_library_call,
    last_user,
    reaches_output,
    refresh_layouts,
    tensor_result,
)

log = logging.getLogger(__name__)
dc = torch.ops.dc


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
            gathered = graph.call_function(dc.allgather_param.default, (param, graph_id, ds_id), {"dtype": dtype})
            full = graph.call_function(dc.wait_allgather.default, (gathered, graph_id, ds_id))
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
        last = last_user(graph, aliases)
        anchor = tensor_result(last) or full
        if not is_library_call(last):
            later = first_library_call_reading(last)
            if later is not None and tensor_result(later) is not None:
                anchor = tensor_result(later)
        with graph.inserting_after(anchor):
            released = graph.call_function(dc.release_param.default, (anchor, graph_id, ds_id, 1))
        released.meta["val"] = anchor.meta.get("val")
        anchor.replace_all_uses_with(released, delete_user_cb=lambda u: u is not released)
    refresh_layouts(graph, gathered_values)
    graph.lint()
    return kept


def _is_matrix_transpose(node: Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return False
    if node.target is torch.ops.aten.t.default:
        return True
    if node.target is torch.ops.aten.permute.default:
        return [d % 2 for d in node.args[1]] == [1, 0]
    return False


def _untransposed_weight_grad(graph, grad: Node) -> Node:
    """``mm(b^T, a^T)`` for a gradient ``t(mm(a, b))``; otherwise ``grad`` itself.

    AOT's decomposition of a linear layer yields its weight gradient as the transpose of a matrix
    product, so Inductor hands reduce_grad a transposed view, and copying that into the reduce
    bucket is a strided gather over the whole weight (on an H200, ~8 ms per step for a 1B model,
    more than the casts and copies of all other gradients together). The product of the swapped,
    transposed operands is the same matrix, laid out contiguously, at no extra cost: a GEMM takes
    transposed operands for free.
    """
    if not _is_matrix_transpose(grad) or len(grad.users) != 1:
        return grad
    product = grad.args[0]
    if product.op != "call_function" or product.target is not torch.ops.aten.mm.default or len(product.users) != 1:
        return grad
    a, b = product.args
    if not all(isinstance(x, Node) and "val" in x.meta for x in (a, b)) or "val" not in grad.meta:
        return grad
    with graph.inserting_before(grad):
        # permute, not t: the graphs reaching the inner compiler are decomposed (Inductor has no
        # lowering for aten.t).
        b_t = graph.call_function(torch.ops.aten.permute.default, (b, [1, 0]))
        a_t = graph.call_function(torch.ops.aten.permute.default, (a, [1, 0]))
        swapped = graph.call_function(torch.ops.aten.mm.default, (b_t, a_t))
    b_t.meta["val"] = b.meta["val"].t()
    a_t.meta["val"] = a.meta["val"].t()
    swapped.meta["val"] = grad.meta["val"].contiguous()
    return swapped


def insert_reductions(gm: GraphModule, graph_id: int, grad_slots: Dict[int, int]) -> List[Node]:
    """Route the gradients at output positions ``grad_slots`` (position -> ds id) to reduce_grad.

    The outputs become None: parameter gradients exist only in the partitions.
    """
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    reductions: List[Node] = []
    replaced: List[Node] = []  # transposes and their products, rewritten as untransposed products
    for position, ds_id in sorted(grad_slots.items()):
        grad = outputs[position]
        if not isinstance(grad, Node):
            continue  # frozen or unused parameter: no gradient
        untransposed = _untransposed_weight_grad(graph, grad)
        if untransposed is not grad:
            replaced += [grad, grad.args[0]]
            grad = untransposed
        with graph.inserting_after(grad):
            reduced = graph.call_function(dc.reduce_grad.default, (grad, graph_id, ds_id))
        reduced.meta["val"] = grad.meta["val"].new_empty((0,)) if "val" in grad.meta else None
        reductions.append(reduced)
        outputs[position] = None
    if reductions:
        with graph.inserting_before(output):
            graph.call_function(dc.end_backward.default, (reductions, graph_id, False))
    output.args = (tuple(outputs),)
    for node in dict.fromkeys(replaced):  # a transpose before its product, which then has no user left
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    return reductions
