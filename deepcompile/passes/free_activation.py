"""``compile.free_activation``: free saved activations in the backward right after their last use.

For each backward placeholder that is an exclusive saved value of the forward
(``saved_values.py``: computed by the forward, not a parameter or any forward input, no view of it
seen by the caller or saved separately), a ``dc.free_tensors`` call goes right after the last node
that reads it or a view of it. One call per such node frees every value whose last use it is. The
call is made through ``dcact.free_after(values, [results of every reader])``: the extra operands
keep Inductor from running it before reads it fuses into later kernels (offload/activation_ops.py).
``free_tensors`` empties the storage itself (C++ ``StorageImpl::reset``), so every view of it is
emptied with it: that is why views are part of the last-use analysis and why values whose views
escape are left alone.

Left alone as well:

* values read by a runtime op (``dc.*``): the reduce lane may still read them after it returns;
* values the backward returns, or returns a view of;
* values of at most ``free_activation_threshold`` bytes, when their size is static (the C++ op
  checks the same byte threshold at run time, for symbolic sizes too: DeepSpeed compared element
  counts with a threshold documented in bytes);
* incoming gradients (``tangents_*``). DeepSpeed frees them too, but autograd may hand the same
  gradient tensor to another branch (an addition's backward passes its incoming gradient to both
  operands unchanged), and a caller's ``backward(gradient=...)`` tensor is the caller's: neither is
  known to be dead when this graph is done with it.

Works for every inner compiler: ``free_tensors`` declares that it mutates its inputs, so Inductor
keeps it after every read of them that it has realized, and the ordering operands realize them
all (DeepSpeed inserted it only with its eager backend).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch.fx import GraphModule, Node

from deepcompile import compat, ops
from deepcompile.passes.graph_utils import alias_closure, last_user, reaches_output
from deepcompile.passes.offload_activation import _latest, ordering_operands
from deepcompile.passes.saved_values import SavedValue, saved_placeholders, storage_closure


def insert_frees(backward: GraphModule, saved: Dict[str, SavedValue], threshold_bytes: int) -> List[str]:
    """Insert ``dc.free_tensors`` after the last use of each freeable saved value; returns their names."""
    graph = backward.graph
    by_anchor: Dict[Node, List[Node]] = {}
    for placeholder in saved_placeholders(backward, saved):
        nbytes = saved[placeholder.name].nbytes
        if nbytes is not None and nbytes <= threshold_bytes:
            continue
        closure = storage_closure(graph, placeholder)
        if reaches_output(closure):
            continue
        readers = [u for v in closure for u in v.users if u not in closure]
        if any(compat.operator_namespace(u.target) == ops.RUNTIME_NAMESPACE for u in readers if u.op == "call_function"):
            continue
        anchor = last_user(graph, closure)
        if anchor is None or anchor.op == "placeholder":
            continue  # read by nothing: aot_autograd drops it with the argument list
        after = ordering_operands(closure)
        if after is None:
            continue
        anchor = _latest(graph, [anchor, *after])
        entry = by_anchor.setdefault(anchor, ([], {}))
        entry[0].append(placeholder)
        entry[1].update(dict.fromkeys(after))
    freed = []
    for anchor, (values, after) in by_anchor.items():
        with graph.inserting_after(anchor):
            graph.call_function(ops.FREE_AFTER, (values, list(after)))
        freed += [v.name for v in values]
    graph.lint()
    return freed
