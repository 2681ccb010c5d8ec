"""``compile.debug_checks``: verify, while training, the two invariants whose violation gives a
silently wrong result rather than an error.

1. **No placeholder data reaches a computation.** A ZeRO-3 parameter is a placeholder outside
   its gathers, whose storage refuses reads (a read raises on its own). When a graph half is
   compiled, every partitioned-parameter input must be read by gathers only (shape queries and
   being saved for the backward aside), so the error names the graph rather than surfacing at run
   time; after every backward, the loss and every gradient partition the runtime holds must be
   finite (with a torch that cannot refuse the read, the placeholder's NaN shows up there).
2. **Every gradient is reduced exactly as often as it is produced.** A ledger counts, per
   parameter, the gradients produced in the accumulation window: one per backward run of a
   compiled graph that reduces it, one per eager reduction. At the window's optimizer step it is
   compared with the number of gradients the runtime actually received (``runtime.reduce_counts``).
   A reduction that a compiler dropped, or a gradient reduced both by a graph and an eager hook,
   makes them differ.

The ledger is module-level because its producers (autograd functions of eager frames, compiled
graph halves) hold no reference to the engine; the engine installs it when the key is on and
removes it at ``destroy``. With the key off every hook below is a no-op test of ``None``.
"""

from __future__ import annotations

import collections
from typing import Dict, Iterable, List, Mapping, Optional

import torch
from torch.fx import GraphModule, Node

from deepcompile import ops


class DebugCheckError(RuntimeError):
    """An invariant checked by compile.debug_checks does not hold."""


class ReductionLedger:
    def __init__(self, names: Mapping[int, str]):
        self.names = dict(names)
        self.expected: Dict[int, int] = collections.Counter()
        self.windows_checked = 0

    def produced(self, ds_ids: Iterable[int]) -> None:
        for ds_id in ds_ids:
            self.expected[ds_id] += 1

    def check_window(self, received: Mapping[int, int]) -> None:
        """Compare the window's produced gradients with what the runtime received; then reset."""
        wrong = []
        for ds_id in sorted(set(received) | set(self.expected)):
            want, got = self.expected.get(ds_id, 0), received.get(ds_id, 0)
            if want != got:
                wrong.append(f"{self.names.get(ds_id, ds_id)}: {want} gradient(s) produced, {got} reduced")
        self.expected = collections.Counter()
        self.windows_checked += 1
        if wrong:
            raise DebugCheckError("compile.debug_checks: gradients lost or counted twice in this accumulation "
                                  "window:\n  " + "\n  ".join(wrong))


LEDGER: Optional[ReductionLedger] = None


def install(ledger: Optional[ReductionLedger]) -> None:
    global LEDGER
    LEDGER = ledger


def note_reductions(ds_ids: Iterable[int]) -> None:
    """A producer (graph backward, eager hook) hands these gradients to the runtime once each."""
    if LEDGER is not None:
        LEDGER.produced(ds_ids)


# Reading a placeholder for its metadata, or handing it on unread, does not read its data.
_METADATA_TARGETS = ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset")


def check_placeholders_only_gathered(gm: GraphModule, params: Mapping[Node, int], names: Mapping[int, str],
                                     phase: str) -> None:
    """Every reader of a partitioned-parameter input of ``gm`` must be a gather."""
    gathers = (ops.ALLGATHER_PARAM, ops.PREFETCH_PARAMS_FUSED)
    bad: List[str] = []
    for node, ds_id in params.items():
        for user in node.users:
            if user.op == "output" or user.target in gathers:
                continue
            if any(part in str(user.target) for part in _METADATA_TARGETS):
                continue
            bad.append(f"{names.get(ds_id, ds_id)} is read by {user.format_node()}")
    if bad:
        raise DebugCheckError(f"compile.debug_checks: the {phase} graph reads ZeRO-3 placeholder data:\n  "
                              + "\n  ".join(bad))


def check_finite(what: str, tensors: Mapping[str, torch.Tensor]) -> None:
    bad = [name for name, t in tensors.items() if t is not None and t.is_floating_point()
           and not bool(torch.isfinite(t).all())]
    if bad:
        raise DebugCheckError(f"compile.debug_checks: {what} not finite: {', '.join(bad[:10])}"
                              f"{' ...' if len(bad) > 10 else ''}. A parameter's placeholder reached a "
                              "computation, or the model diverged.")
