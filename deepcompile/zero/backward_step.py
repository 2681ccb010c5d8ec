"""ZeRO-3's optimizer step inside the backward (``compile.optimizer_step_in_backward``).

Without it a backward ends holding every gradient partition of the window, and the optimizer
step consumes them afterwards. With activation checkpointing that is what sets the peak: the end
of the backward holds all partitions plus one recomputed layer, while the plain run peaks at the
backward's start, before any partition exists (bench/results/2026-11-25.md, "With the sub-group
step, and where the peaks are now"). Here a parameter steps as soon as its gradient for the
window is final, and its partition is dropped right away, so a backward holds about one layer's
partitions at a time.

When a gradient is final. The runtime counts the reductions of each parameter in the window
(``runtime.reduce_counts``). A parameter reduced once per micro-step is final after its
reduction in the last micro-step; a tied or reused one only after its last use. This class
learns, per parameter, the most reductions a window has had (from complete windows that nothing
profiled, whose counts are exact), and in a later window's last micro-step steps a parameter
when its count reaches that number. The first window therefore steps as before.

Where. After each compiled backward graph (compiler/backend.py runs ``after_graph`` with the ds
ids the graph reduced). Each graph ends in ``dc.end_backward``, which flushes every queued
reduction and makes the compute stream wait for them, so the partitions are complete, in stream
order, when the step reads them. With regional compilation (``engine.compile(regional=True)``)
every layer's backward is a graph of its own, and its parameters step as the backward leaves it;
a whole-model graph has one such point, at its end, and gains nothing.

Leaf modules (zero/leaf_modules.py: marked with ``set_leaf_modules``, or by the backend where a
graph reading parameters through a custom operator cannot compile, as transformers' grouped-mm
experts on CUDA) run eagerly inside a compiled layer, and their backward queues their reductions
outside any graph. It tells this class which (``note_eager_reductions``); the next compiled
backward graph's ``dc.end_backward`` flushes them with its own, so they step after that graph
like its parameters do. A leaf that no compiled backward graph follows (the first module of the
model) steps in ``engine.step()``, as do the parameters of other eagerly run code (the embedding,
the head and the modules outside compiled layers).

What it needs, checked by the config (config.py): ZeRO-3, no gradient clipping (the global norm
needs every gradient before the first update), no optimizer-state or parameter offload (their
step streams state through host memory, sub-group by sub-group). The global gradient norm is
still reported: each rank adds up the squares of what it stepped early.

The update itself is bitwise the normal step's: a plain ``optimizer.step()`` over a subset
(zero/sub_groups.py says why that is exact), at the same learning rate (the scheduler advances in
``engine.step()``, after every parameter stepped).

A parameter whose use grows (more reductions in a window than any earlier window had) would have
stepped before its last gradient arrived: that cannot be undone, so the window ends with an error
that names it, rather than a silently wrong update.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from deepcompile import debug_checks, runtime
from deepcompile.zero.optimizer import ShardedOptimizer


class StepInBackwardError(RuntimeError):
    pass


class BackwardStep:
    """Steps ZeRO-3 parameters during the backward of an accumulation window's last micro-step."""

    def __init__(self, optimizer: ShardedOptimizer, names: Dict[int, str], sub_group_size: Optional[int] = None):
        self.optimizer = optimizer
        self.names = names  # ds id -> parameter name, for errors
        self.sub_group_size = sub_group_size
        self.trainable = {sp.ds_id for sp in optimizer.trainable}
        # ds id -> the most reductions a complete, unprofiled window gave it.
        self.final_count: Dict[int, int] = {}
        self.armed = False
        self._window_exact = True  # no micro-step of this window was profiled
        self._stepped: Dict[int, int] = {}  # ds id -> its reduction count when it stepped, this window
        self._spent_square: Optional[torch.Tensor] = None
        self.stepped_last_window: List[int] = []  # ds ids stepped in the backward, for reports and tests
        self._graph_ran = False  # a compiled backward graph reported to an armed window
        # Reductions a leaf's backward queued since the last graph reported (note_eager_reductions).
        self._eager_reduced: List[int] = []
        self._warned = False

    def begin_backward(self, boundary: bool, profiled: bool) -> None:
        """Before each micro-step's backward. ``profiled``: the schedule driver runs this
        micro-step's graphs through the profiler (the runtime does not count its reductions)."""
        if profiled:
            self._window_exact = False
        self.armed = boundary and not profiled and bool(self.final_count)
        self._eager_reduced = []

    def note_eager_reductions(self, ds_ids: Sequence[int]) -> None:
        """A leaf module's backward queued reductions of ``ds_ids`` (eager code, no graph's own):
        they are flushed by the next compiled backward graph, which steps them if final."""
        if self.armed:
            self._eager_reduced.extend(ds_ids)

    def after_graph(self, ds_ids: Sequence[int]) -> None:
        """A compiled backward graph that reduced ``ds_ids`` has run: step those, and those a
        leaf reduced before it (its ``dc.end_backward`` flushed every queued reduction), whose
        gradient is now final."""
        if not self.armed:
            return
        self._graph_ran = True
        if self._eager_reduced:
            ds_ids, self._eager_reduced = [*ds_ids, *self._eager_reduced], []
        # Only this graph's ids: the whole map would cost every parameter per layer graph.
        counts = {i: runtime.reduce_count(i) for i in dict.fromkeys(ds_ids)}
        self._check_not_late(ds_ids, counts)
        ready = [i for i, n in counts.items()
                 if i in self.trainable and i not in self._stepped and n == self.final_count.get(i)]
        if not ready:
            return
        if debug_checks.LEDGER is not None:  # compile.debug_checks: engine.step() will not see these
            debug_checks.check_finite("reduced gradients", {self.names.get(i, str(i)): runtime.grad_target(i)
                                                            for i in ready})
        square = self.optimizer.step_now(ready, self.sub_group_size)
        self._spent_square = square if self._spent_square is None else self._spent_square + square
        for i in ready:
            self._stepped[i] = counts[i]

    def end_window(self, counts: Dict[int, int]):
        """At the optimizer step (``counts``: the window's reductions). Returns (the ds ids
        stepped during the backward, the sum of squares of their gradients or None), checks that
        none of them received a gradient after it stepped, and learns from an exact window."""
        try:
            self._check_not_late(list(self._stepped), counts)
            if self.armed and not self._graph_ran:
                self._warn_no_graphs()
            if self._window_exact:
                for ds_id in self.trainable:
                    n = counts.get(ds_id, 0)
                    if n > self.final_count.get(ds_id, 0):
                        self.final_count[ds_id] = n
            stepped, square = list(self._stepped), self._spent_square
            self.stepped_last_window = stepped
            return stepped, square
        finally:
            self._graph_ran = False
            self._eager_reduced = []
            self._stepped = {}
            self._spent_square = None
            self._window_exact = True
            self.armed = False

    def _warn_no_graphs(self) -> None:
        """The option is on, but nothing gave it a place to step (never silently without effect)."""
        if self._warned:
            return
        self._warned = True
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn("compile.optimizer_step_in_backward: no compiled backward graph ran in this accumulation "
                          "window (engine.compile() was not called, or every frame ran eagerly), so every parameter "
                          "stepped in engine.step() as without the option. It steps after compiled backward graphs; "
                          "engine.compile(regional=True) gives one per layer", stacklevel=4)

    def _check_not_late(self, ds_ids: Sequence[int], counts: Dict[int, int]) -> None:
        late = [i for i in ds_ids if i in self._stepped and counts.get(i, 0) > self._stepped[i]]
        if late:
            described = ", ".join(f"{self.names.get(i, i)} ({counts.get(i, 0)} reductions, stepped after "
                                  f"{self._stepped[i]})" for i in late[:6])
            raise StepInBackwardError(
                "compile.optimizer_step_in_backward: parameters received a gradient after their optimizer step in "
                f"this window: {described}. They were used more often than in any earlier window, so their update "
                "missed that gradient. Turn compile.optimizer_step_in_backward off for a model whose parameters are "
                "used a varying number of times per step")

    def close(self) -> None:
        self.optimizer = None
        self.armed = False
