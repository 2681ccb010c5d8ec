"""The gradient pass (every ZeRO stage): parameter gradients leave the backward graph through
the runtime's reduce buckets instead of autograd.

Every parameter gradient the backward graph returns goes to ``dc.reduce_grad`` and the graph
returns None in its place: gradients exist only in the partitions. The graph then ends with
``dc.end_backward``, which depends on every reduction, so no compiler can hoist it above them.
A weight gradient that arrives as the transpose of a matrix product is recomputed as the product
of the transposed operands, so the reduction reads it contiguous.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch.fx import GraphModule, Node

from deepcompile import ops


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
    bucket is a strided gather over the whole weight, costlier than the casts and copies of all
    other gradients together (docs/design/measured.md). The product of the swapped, transposed
    operands is the same matrix, laid out contiguously, at no extra cost: a GEMM takes transposed
    operands for free.
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
            reduced = graph.call_function(ops.REDUCE_GRAD, (grad, graph_id, ds_id))
        reduced.meta["val"] = grad.meta["val"].new_empty((0,)) if "val" in grad.meta else None
        reductions.append(reduced)
        outputs[position] = None
    if reductions:
        with graph.inserting_before(output):
            graph.call_function(ops.END_BACKWARD, (reductions, graph_id, False))
    output.args = (tuple(outputs),)
    for node in dict.fromkeys(replaced):  # a transpose before its product, which then has no user left
        if not node.users:
            graph.erase_node(node)
    graph.lint()
    return reductions
