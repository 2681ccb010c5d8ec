"""Activation offload at run time: the ops the offload pass inserts, and what they keep.

Three ops (namespace ``dcact``, schemas and fake kernels in ``deepcompile/ops.py``; their
kernels are here), all no-ops for a tensor the plan keeps on the device:

* ``offload_activation(Tensor(a!) x, int key) -> ()``, in the forward after the last use of a
  saved activation ``x``: copies ``x`` into a host buffer on the offload lane, then frees ``x``'s
  device storage (``untyped_storage().resize_(0)``). The tensor object itself survives: it is what
  autograd saved for the backward, and the host copy is filed under it.
* ``reload_activation(Tensor(a!) x, int key) -> ()``, in the backward ahead of the first use:
  re-allocates ``x``'s storage (on the compute stream, so the block is the compute stream's) and
  copies the host buffer back on the reload lane, which first waits for the compute stream (the
  block may have served work still queued there).
* ``wait_reload(Tensor(a) x, int key) -> Tensor(a)``, just before the first use: the compute
  stream waits for the reload's event; its users read its result.

``after`` (offload) lists results of every node that reads ``x``: operands only for ordering.
Inductor realizes a pointwise result lazily, when a consumer needs it, so a read of ``x`` fused
into a later kernel would be placed after the op that frees ``x`` (seen: a segfault), whatever the
op's mutation annotation says. An operand forces those reads to be realized first. The cost: each
reader's result is materialized instead of fused into its consumer. ``free_after(xs, after)`` is ``dc.free_tensors(xs)`` with
the same operand (its C++ schema has none), used by ``compile.free_activation``.

Why the ops mutate ``x`` rather than returning fresh tensors: the schemas tell every compiler that
``x`` changes there, so no reader of ``x`` is moved across them (Inductor orders a mutation after
the reads before it), and the forward output slot keeps returning the very object autograd saves.
The fake kernels of the first two return nothing, so no fake tensor claims a device the real
result is not on (DeepSpeed's gap 14: its ``offload_tensor`` returns a host tensor faked as a
device one).

The host copy is filed under the tensor object (a weak-keyed map), never under ``key`` alone: a
graph that runs twice before its backward (or again to recompute checkpointed layers) offloads two
tensors with one key, and each gets its own buffer of its own shape (DeepSpeed's gap 13: one
buffer per key, allocated once, its shape never re-checked). Pinned buffers come from torch's
caching host allocator, which reuses them across steps and knows when a copy still reads them.

Which runs of which keys are offloaded is decided at run time (:class:`ActivationOffloader`,
``plan``): the graph holds the ops for every eligible activation, and re-planning costs no
recompile.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from deepcompile import compat, ops
from deepcompile.offload import device_memory
from deepcompile.offload.lanes import CopyLanes



@dataclasses.dataclass
class _Stashed:
    host: torch.Tensor
    written: Optional[object]  # the offload's completion event (None: done)
    reloaded: Optional[object] = None  # the reload's completion event, once issued
    nbytes: int = 0


@dataclasses.dataclass
class KeyStats:
    """What one offload site (one graph node) moved, for the plan and the schedule report."""

    key: int
    name: str
    nbytes: int = 0  # of one run's tensor
    offloads: int = 0  # runs in which this site offloaded
    kept: int = 0  # runs in which the plan (or a shared storage) kept it on the device
    # The most runs of this site in one micro-step. A graph whose instances serve several layers
    # (regional compilation: one compiled decoder layer, its offload ops and their keys, run once
    # per layer) or a module called twice per forward runs a site several times; the plan
    # decides each run, (key, run), on its own.
    runs_per_micro_step: int = 0

    @property
    def bytes_per_micro_step(self) -> int:
        """What the plan weighs for this key: every tensor its decision applies to."""
        return self.nbytes * max(self.runs_per_micro_step, 1)


class ActivationOffloader:
    """The run-time state of activation offload for one engine.

    ``plan``: the runs to offload, as (key, run) pairs, ``run`` counting a key's runs within one
    micro-step from 0 (a shared layer graph runs its keys once per layer: the plan can move the
    first layers' tensors and keep the last ones'); None offloads every run (before a plan exists,
    and on a CPU device without a budget).
    """

    def __init__(self, device: torch.device, pin_memory: bool,
                 resident_elsewhere: Optional[Callable[[], int]] = None):
        self.device = device
        self.pin_memory = bool(pin_memory) and device.type == "cuda"
        self.lanes = CopyLanes(device)
        self.plan: Optional[Set[Tuple[int, int]]] = None
        self.stats: Dict[int, KeyStats] = {}
        # Keyed by storage, not by tensor object: Inductor may offload one tensor object (a
        # `reinterpret_tensor` of its buffer) and hand autograd another over the same storage.
        self._stash = compat.weak_id_key_dictionary()
        # The most device memory allocated at any op call while ``sample`` (the plan's floor).
        self.sample = True
        self.observed_peak = 0
        # Bytes of other offloadable state on the device now (optimizer-state and parameter
        # offload's resident units), left out of the floor: the joint plan (offload/joint.py)
        # counts them as its own candidates. None: nothing left out.
        self.resident_elsewhere = resident_elsewhere
        self._runs_now: Dict[int, int] = {}  # runs per key in the current micro-step
        self._order_now: List[Tuple[int, int]] = []  # (key, run) in the order they ran
        # Per (key, run), the fraction of the last complete micro-step's offload sites that ran
        # before it: where in the forward the tensor is computed, as far as the sites tell.
        self.positions: Dict[Tuple[int, int], float] = {}

    def end_micro_step(self) -> None:
        """Folds the runs counted since the last call into ``runs_per_micro_step`` (the engine calls
        it before every forward; the planners before they read the stats)."""
        for key, runs in self._runs_now.items():
            stats = self.stats[key]
            stats.runs_per_micro_step = max(stats.runs_per_micro_step, runs)
        if self._order_now:
            n = len(self._order_now)
            self.positions = {run: i / n for i, run in enumerate(self._order_now)}
        self._runs_now.clear()
        self._order_now.clear()

    def _sample(self) -> None:
        if self.sample:
            other = self.resident_elsewhere() if self.resident_elsewhere is not None else 0
            self.observed_peak = max(self.observed_peak, device_memory.allocated(self.device) - other)

    def site(self, key: int, name: str) -> None:
        self.stats.setdefault(key, KeyStats(key, name))

    def offload(self, x: torch.Tensor, key: int) -> None:
        self._sample()
        stats = self.stats.setdefault(key, KeyStats(key, f"key {key}"))
        nbytes = x.numel() * x.element_size()
        stats.nbytes = nbytes
        run = self._runs_now.get(key, 0)
        self._runs_now[key] = run + 1
        self._order_now.append((key, run))
        if (self.plan is not None and (key, run) not in self.plan) or not _owns_storage(x):
            # A tensor that shares its storage (a buffer a compiler laid out around it) cannot be
            # freed alone: it stays.
            stats.kept += 1
            return
        try:
            host = torch.empty_like(x, device="cpu", pin_memory=self.pin_memory)
        except RuntimeError as e:
            raise RuntimeError(f"deepcompile: activation offload could not allocate {nbytes} bytes of "
                               f"{'pinned' if self.pin_memory else 'pageable'} host memory: {e}") from e
        written = self.lanes.offload(host, x)  # tells the allocator the offload lane reads x
        x.untyped_storage().resize_(0)
        self._stash[compat.storage_object(x)] = _Stashed(host, written, nbytes=nbytes)
        stats.offloads += 1

    def reload(self, x: torch.Tensor, key: int) -> None:
        self._sample()
        entry = self._stash.get(compat.storage_object(x))
        if entry is None:
            if x.untyped_storage().nbytes() == 0 and x.numel() > 0:
                raise RuntimeError(
                    f"deepcompile: activation offload site {key}: the backward received a saved activation whose "
                    "device storage was freed and no host copy is filed under it (was it replaced by another tensor "
                    "between the forward and the backward, e.g. by a saved-tensor hook?)")
            return  # kept on the device
        if entry.reloaded is not None:
            return  # reloaded already (a backward graph that reads it twice)
        x.untyped_storage().resize_(entry.nbytes)  # x spanned its whole storage (_owns_storage)
        entry.reloaded = self.lanes.reload(x, entry.host, entry.written) or True

    def wait(self, x: torch.Tensor, key: int) -> None:
        self._sample()
        entry = self._stash.pop(compat.storage_object(x), None)
        if entry is None:
            return
        if entry.reloaded is None:
            raise RuntimeError(f"deepcompile: activation offload site {key}: wait_reload before reload_activation")
        if entry.reloaded is not True:
            self.lanes.wait(entry.reloaded)

    def pending(self) -> int:
        """Activations on the host, not yet waited for."""
        return len(self._stash)

    def planning_runs(self) -> List[Tuple[KeyStats, int]]:
        """The plan's candidates: every run of every site that has offloaded (one that shares its
        storage never moves), in forward order as far as the counts tell: every key's first run
        (in the order the keys first ran), then every second run, and so on; the planners take
        the earlier of equal candidates first."""
        self.end_micro_step()
        runs = [(s, run) for s in self.stats.values() if s.offloads > 0
                for run in range(max(s.runs_per_micro_step, 1))]
        return sorted(runs, key=lambda sr: sr[1])  # stable: key order within a run

    def planned_runs(self, s: KeyStats) -> int:
        """How many of ``s``'s runs per micro-step the plan offloads."""
        runs = max(s.runs_per_micro_step, 1)
        return runs if self.plan is None else sum((s.key, run) in self.plan for run in range(runs))

    def report(self, bandwidth_bytes_per_s: Optional[float]) -> List[Dict]:
        self.end_micro_step()
        out = []
        for s in sorted(self.stats.values(), key=lambda s: -s.bytes_per_micro_step):
            moved = s.nbytes * self.planned_runs(s)
            out.append({
                "key": s.key, "tensor": s.name, "bytes": s.bytes_per_micro_step, "offloaded_bytes": moved,
                "offloaded": moved == s.bytes_per_micro_step and moved > 0,
                "tensor_bytes": s.nbytes, "runs_per_micro_step": s.runs_per_micro_step,
                "runs_offloaded": s.offloads, "runs_kept": s.kept,
                # Offload and reload, at the measured host-to-device bandwidth.
                "predicted_transfer_ms": (2e3 * moved / bandwidth_bytes_per_s
                                          if moved and bandwidth_bytes_per_s else None),
            })
        return out


def _owns_storage(x: torch.Tensor) -> bool:
    """True if ``x``'s storage is exactly its own size from offset 0: ``x`` is not a part of a larger
    buffer, so freeing the storage frees only ``x``'s bytes. (The copies go through ``copy_``, so
    any layout, transposed included, round-trips.)"""
    if x.numel() == 0 or x.storage_offset() != 0:
        return False
    return x.untyped_storage().nbytes() == x.numel() * x.element_size()


_ACTIVE: Optional[ActivationOffloader] = None


def activate(offloader: Optional[ActivationOffloader]) -> None:
    """Make ``offloader`` the one the ops act for (None: the ops do nothing)."""
    global _ACTIVE
    _ACTIVE = offloader


def active() -> Optional[ActivationOffloader]:
    return _ACTIVE


# ---- kernels -----------------------------------------------------------------------------------


def _offload_kernel(x: torch.Tensor, after: List[torch.Tensor], key: int) -> None:
    if _ACTIVE is not None:
        _ACTIVE.offload(x, key)


@dataclasses.dataclass
class FreeCounts:
    """What ``free_after`` freed in this process (``dc.free_tensors`` applies the byte threshold)."""

    tensors: int = 0
    bytes: int = 0


FREED = FreeCounts()


def _free_after_kernel(xs: List[torch.Tensor], after: List[torch.Tensor]) -> None:
    held = [x.untyped_storage().nbytes() for x in xs]
    ops.free_tensors(xs)
    for x, before in zip(xs, held):
        if before and x.untyped_storage().nbytes() == 0:
            FREED.tensors += 1
            FREED.bytes += before


def _reload_kernel(x: torch.Tensor, key: int) -> None:
    if _ACTIVE is not None:
        _ACTIVE.reload(x, key)


def _wait_kernel(x: torch.Tensor, key: int) -> torch.Tensor:
    if _ACTIVE is not None:
        _ACTIVE.wait(x, key)
    return x.view(x.shape)


# The schemas and fake kernels are in deepcompile/ops.py; these kernels act on the state above.
ops.register_activation_kernels({
    "offload_activation": _offload_kernel,
    "reload_activation": _reload_kernel,
    "wait_reload": _wait_kernel,
    "free_after": _free_after_kernel,
})
