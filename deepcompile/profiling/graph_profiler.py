"""Profile one run of a compiled graph with real tensors, node by node.

The profiled run *is* the training step's run of that graph: the FX graph (after the ZeRO pass,
before the inner compiler) is executed by an interpreter on the step's real inputs and its outputs
are what autograd receives. So profiling costs one eager execution of each graph, not extra
iterations, and it never disturbs the RNG stream or the runtime's state.

Per node the profile records
  * ``time_ms``: device time (CUDA events on the current stream) or wall clock on CPU;
  * ``out_bytes``: bytes of the node's tensor outputs;
  * ``mem_bytes``: memory in use after the node: ``torch.cuda.memory_allocated()`` on GPU; on CPU
    the bytes of the distinct storages the graph holds at that point (its working set);
  * ``peak_bytes``: ``mem_bytes`` before the node plus its output bytes (the outputs exist while
    the inputs are still alive) plus the scratch the op is known to hold while it runs
    (:func:`scratch_bytes`: the all-to-all's exchange buffer). The allocator's own peak counter is
    not reset, so a user's ``max_memory_allocated`` bookkeeping is left alone; the price is that
    an op's temporaries are seen only where they are modelled.

Agreement across ranks: all numbers are reduced with MAX over the ranks at the end, so every
rank plans from the same values and takes the same decisions.

Failure protocol (a rank's failure must not hang the others): before every node that issues a
collective (gathers, reductions) and once at the end, the ranks vote with one MAX all-reduce of a
"failed" flag. A rank whose node raised stops executing and keeps voting; as soon as a vote sees a
failure, every rank raises :class:`ProfileAborted` at the same node, before entering the
collective. The caller then decides how to finish the step (see ``scheduling/driver.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.fx import GraphModule, Interpreter, Node

from deepcompile import compat, ops



class ProfileAborted(RuntimeError):
    """A rank failed while profiling; raised on every rank at the same node."""

    def __init__(self, node: str, reduced: bool, message: str):
        super().__init__(message)
        self.node = node
        self.reduced = reduced  # gradients were already reduced when the run stopped


@dataclasses.dataclass
class NodeProfile:
    name: str
    target: str
    time_ms: float = 0.0
    out_bytes: int = 0
    mem_bytes: int = 0
    peak_bytes: int = 0
    scratch_bytes: int = 0  # last: profiles are built positionally (tests, merged instance profiles)


@dataclasses.dataclass
class GraphProfile:
    """The profile of one graph (forward or backward half)."""

    graph_id: int
    phase: str  # "forward" | "backward"
    nodes: List[NodeProfile]
    complete: bool = True
    error: str = ""

    @property
    def peak_bytes(self) -> int:
        return max((n.peak_bytes for n in self.nodes), default=0)

    @property
    def total_time_ms(self) -> float:
        return sum(n.time_ms for n in self.nodes)

    def by_name(self) -> Dict[str, NodeProfile]:
        return {n.name: n for n in self.nodes}


def _collective_targets():
    return (
        ops.ALLGATHER_PARAM,
        ops.PREFETCH_PARAMS_FUSED,
        ops.REDUCE_GRAD,
        ops.END_BACKWARD,
        ops.ALL_TO_ALL,  # sequence parallelism: a rank that failed before it must not leave the others in it
    )


def scratch_bytes(node: Node, out_bytes: int) -> int:
    """Bytes ``node``'s op holds while it runs beyond its inputs and outputs, which neither the
    allocator's reading after the node nor the live values show. The all-to-all
    (sequence_parallel/all_to_all.py) exchanges through a received buffer of its output's size,
    alive with the send buffer first and with the output after, so its peak is its inputs plus
    twice its output. Other ops' temporaries are not modelled."""
    if node.op == "call_function" and node.target is ops.ALL_TO_ALL:
        return out_bytes
    return 0


def issues_collective(node: Node) -> bool:
    return node.op == "call_function" and node.target in _collective_targets()


def _tensors(value: Any) -> List[torch.Tensor]:
    return [v for v in compat.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = compat.storage_id(t)  # not data_ptr(): a ZeRO-3 placeholder's storage refuses that
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class _Vote:
    """MAX all-reduce of one flag over the group: the failure vote."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        self.group = group
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.enabled = dist.is_initialized()

    def anyone_failed(self, failed: bool) -> bool:
        if not self.enabled:
            return failed
        self.flag.fill_(int(failed))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.flag.item())


class _TrackedEnv(dict):
    """The interpreter's node -> value map, also keeping each live value's tensor storages
    (``storages``, with their keys; only when ``track``: the CPU working set is measured from them)."""

    def __init__(self, track: bool):
        super().__init__()
        self.track = track
        self.storages: Dict[Node, List[Any]] = {}

    def __setitem__(self, node: Node, value: Any) -> None:
        super().__setitem__(node, value)
        if self.track:
            self.storages[node] = [(compat.storage_id(t), t.untyped_storage()) for t in _tensors(value)]

    def __delitem__(self, node: Node) -> None:
        super().__delitem__(node)
        self.storages.pop(node, None)


class GraphProfiler(Interpreter):
    """Runs ``gm`` once on real inputs and records a :class:`GraphProfile`.

    ``fail_at`` (tests only) makes the node of that name raise on this rank.
    """

    def __init__(self, gm: GraphModule, graph_id: int, phase: str, device: torch.device,
                 group: Optional[dist.ProcessGroup] = None, fail_at: Optional[str] = None):
        super().__init__(gm, garbage_collect_values=True)
        self.graph_id = graph_id
        self.phase = phase
        self.device = device
        self.cuda = device.type == "cuda"
        self.group = group
        self.fail_at = fail_at
        self.profile = GraphProfile(graph_id, phase, [])
        self._events: List[Any] = []
        self._failed: Optional[BaseException] = None
        self._reduced = False
        self._vote = _Vote(group, device if self.cuda else torch.device("cpu"))

    # ---- memory ----------------------------------------------------------------------------

    def _memory(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        # The storages of each live value are listed once, when the value is stored; their sizes
        # are read now (a gathered buffer may have been freed since). Listing them from the
        # values at every node made the CPU profile quadratic in the graph's size.
        seen, total = set(), 0
        for storages in self.env.storages.values():
            for key, storage in storages:
                if key in seen:
                    continue
                nbytes = storage.nbytes()
                if nbytes == 0:
                    continue
                seen.add(key)
                total += nbytes
        return total

    # ---- interpreter hooks -----------------------------------------------------------------

    def run_node(self, n: Node) -> Any:
        # The interpreter dropped the previous node's dead values just before this call.
        self._settle()
        if issues_collective(n) and self._vote.anyone_failed(self._failed is not None):
            self._abort(n)
        if self._failed is not None:
            return None  # this rank already failed: skip work, keep voting
        record = NodeProfile(n.name, str(n.target))
        before = self._last_mem
        try:
            if self.fail_at == n.name:
                raise RuntimeError(f"injected profiling failure at node {n.name}")
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = super().run_node(n)
                end.record()
                self._events.append((record, start, end))
            else:
                t0 = time.perf_counter()
                result = super().run_node(n)
                record.time_ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 -- any failure is voted on, then re-raised everywhere
            self._failed = e
            return None
        if n.op == "call_function" and n.target is ops.REDUCE_GRAD:
            self._reduced = True
        record.out_bytes = _bytes(_tensors(result)) if n.op != "placeholder" else 0
        record.scratch_bytes = scratch_bytes(n, record.out_bytes)
        self.profile.nodes.append(record)
        self._pending = (record, before)
        return result

    def _abort(self, n: Node) -> None:
        reason = repr(self._failed) if self._failed is not None else "another rank failed"
        raise ProfileAborted(
            n.name, self._reduced,
            f"profiling graph {self.graph_id} ({self.phase}) stopped at node {n.name}: {reason}",
        )

    def run(self, *args: Any) -> Any:
        self._pending = None
        self.env = _TrackedEnv(not self.cuda)
        self._last_mem = self._memory()
        result = super().run(*args, initial_env=self.env)
        self._settle()
        if self._vote.anyone_failed(self._failed is not None):
            self._abort(self.module.graph.output_node())
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
            for record, start, end in self._events:
                record.time_ms = start.elapsed_time(end)
        self._agree()
        return result

    def _settle(self) -> None:
        if self._pending is not None:
            record, before = self._pending
            record.mem_bytes = self._last_mem = self._memory()
            record.peak_bytes = max(before + record.out_bytes + record.scratch_bytes, record.mem_bytes)
            self._pending = None

    def _agree(self) -> None:
        """MAX over ranks of every number, so all ranks hold the same profile."""
        if not dist.is_initialized() or not self.profile.nodes:
            return
        nodes = self.profile.nodes
        values = torch.tensor(
            [[n.time_ms, float(n.out_bytes), float(n.mem_bytes), float(n.peak_bytes)] for n in nodes],
            dtype=torch.float64,
        )
        count = torch.tensor([len(nodes), -len(nodes)], dtype=torch.float64)
        device = self.device if self.cuda else torch.device("cpu")
        count = count.to(device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        if int(count[0].item()) != -int(count[1].item()):
            # Different graphs on different ranks: never plan from that.
            self.profile.complete = False
            self.profile.error = "ranks profiled different numbers of nodes"
            return
        values = values.to(device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        for n, row in zip(nodes, values.cpu().tolist()):
            n.time_ms, n.out_bytes, n.mem_bytes, n.peak_bytes = row[0], int(row[1]), int(row[2]), int(row[3])


def profile_graph(gm: GraphModule, args: Sequence[Any], graph_id: int, phase: str, device: torch.device,
                  group: Optional[dist.ProcessGroup] = None, fail_at: Optional[str] = None):
    """Run ``gm`` on ``args`` through the profiler; returns ``(outputs, GraphProfile)``.

    Raises :class:`ProfileAborted` on every rank if any rank failed.
    """
    profiler = GraphProfiler(gm, graph_id, phase, device, group, fail_at)
    outputs = profiler.run(*args)
    return outputs, profiler.profile
