"""``compile.offload_activation``: saved activations wait for the backward in host memory.

Forward: after the last forward use of each candidate, ``dcact.offload_activation(x, key)``
(``offload/activation_ops.py``) copies it to the host on the offload lane and frees its device
storage; the output slot keeps returning ``x``, the object autograd saves.

Backward: ``dcact.wait_reload(x, key)`` goes right before the first node that reads ``x``, and
every reader reads its result instead; ``dcact.reload_activation(x, key)`` goes before it, early
enough that the copy (``bytes / host-to-device bandwidth``) is covered by the profiled time of the
nodes between the two when a profile of the backward exists (:func:`place_reloads`), else right
before the wait. The reload re-allocates on the compute stream, so nothing but the placement
decides how long the reloaded memory is held before its use.

Candidates (as DeepSpeed's, ``saved_values.py``): exclusive saved values (computed by the
forward, no parameter, no view, nothing the caller sees), floating point, on the training device,
of static shape and at least ``min_bytes``. The graph holds the ops for every candidate; which
ones actually move is the run-time plan's choice (``ActivationOffloader.plan``), so planning needs
no recompile, and prefetch, selective gather and optimizer-state offload run alongside.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional

import torch
from torch.fx import GraphModule, Node

from deepcompile import ops
from deepcompile.offload import activation_ops
from deepcompile.passes.graph_utils import alias_closure, first_user, gather_point, last_user, tensor_result
from deepcompile.passes.saved_values import SavedValue, storage_closure

_KEYS = itertools.count(1)  # offload site keys: never reused within a process


@dataclasses.dataclass(frozen=True)
class OffloadSite:
    key: int
    name: str
    nbytes: int


def candidates(saved: Dict[str, SavedValue], device_type: str, min_bytes: int) -> List[str]:
    return [s.name for s in saved.values()
            if s.exclusive and s.floating and s.nbytes is not None and s.nbytes >= max(min_bytes, 1)
            and s.device is not None and s.device.type == device_type]


def ordering_operands(closure) -> Optional[List[Node]]:
    """A tensor result of every node that reads a value (or a view of it, ``closure``), passed to
    the op that frees the value so that every compiler runs it after all of them. Inductor realizes
    a pointwise reader lazily, possibly after a later node: only an operand forces it earlier
    (offload/activation_ops.py). None if a reader has no tensor result."""
    readers = dict.fromkeys(u for v in closure for u in v.users if u not in closure and u.op != "output"
                            and u.target is not ops.RELOAD_ACTIVATION)  # ordered before its wait
    out = []
    for reader in readers:
        result = tensor_result(reader)
        if result is None:
            return None
        out.append(result)
    return out


def _latest(graph, nodes: List[Node]) -> Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return max(nodes, key=order.__getitem__)


def insert_offloads(forward: GraphModule, saved: Dict[str, SavedValue], device_type: str,
                    min_bytes: int) -> Dict[str, OffloadSite]:
    """Insert an offload after the last forward use of every candidate; returns the sites by name."""
    graph = forward.graph
    nodes = {n.name: n for n in graph.nodes}
    sites: Dict[str, OffloadSite] = {}
    for name in candidates(saved, device_type, min_bytes):
        node = nodes[name]
        closure = storage_closure(graph, node)
        anchor = last_user(graph, closure)
        after = ordering_operands(closure)
        if after is None:
            continue
        site = OffloadSite(next(_KEYS), name, saved[name].nbytes)
        with graph.inserting_after(_latest(graph, [anchor, *after])):
            graph.call_function(ops.OFFLOAD_ACTIVATION, (node, after, site.key))
        sites[name] = site
        offloader = activation_ops.active()
        if offloader is not None:
            offloader.site(site.key, name)
    graph.lint()
    return sites


def insert_reloads(backward: GraphModule, sites: Dict[str, OffloadSite]) -> List[Node]:
    """Reload and wait before the first backward use of every offloaded value (just in time);
    returns the reload nodes."""
    graph = backward.graph
    reloads = []
    for placeholder in [n for n in graph.nodes if n.op == "placeholder" and n.name in sites]:
        key = sites[placeholder.name].key
        use = first_user(graph, placeholder)
        if use is None:
            continue
        readers = list(placeholder.users)
        # Before the pointwise region the use belongs to (after the library call before it), not
        # inside it: Inductor does not fuse across these calls (graph_utils.gather_point).
        with graph.inserting_before(gather_point(use)):
            reload = graph.call_function(ops.RELOAD_ACTIVATION, (placeholder, key))
            wait = graph.call_function(ops.WAIT_RELOAD, (placeholder, key))
        wait.meta["val"] = placeholder.meta.get("val")
        for reader in readers:
            reader.replace_input_with(placeholder, wait)
        reload.meta["offload_bytes"] = sites[placeholder.name].nbytes
        reloads.append(reload)
    graph.lint()
    return reloads


def place_reloads(backward: GraphModule, node_time_ms: Dict[str, float], bytes_per_s: float) -> int:
    """Move each reload earlier, until the profiled time of the nodes between it and its wait
    covers its copy time (or it reaches the placeholders); returns how many moved."""
    graph = backward.graph
    moved = 0
    for reload in [n for n in graph.nodes if n.op == "call_function" and n.target is ops.RELOAD_ACTIVATION]:
        need_ms = 1e3 * reload.meta.get("offload_bytes", 0) / bytes_per_s
        covered, point = 0.0, reload
        while covered < need_ms and point.prev.op not in ("placeholder", "root"):
            point = point.prev
            covered += node_time_ms.get(point.name, 0.0)
        if point is not reload:
            point.prepend(reload)
            moved += 1
    graph.lint()
    return moved


def profiled_times(profile) -> Optional[Dict[str, float]]:
    """Per node name, the profiled time (None without a complete profile)."""
    if profile is None or not profile.complete:
        return None
    return {n.name: n.time_ms for n in profile.nodes}
