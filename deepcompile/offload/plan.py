"""Which optimizer-state tensors leave the device: a plan under the memory budget.

Pure arithmetic on byte counts, so it is tested on its own (tests/offload/test_offload.py). The runtime
side (copies, streams, freeing) is ``opt_states.py`` with ``unit_copies.py``.

Model. Between optimizer steps, every tensor the plan keeps *resident* occupies the device through
the whole forward and backward, so it adds to their peak; an *offloaded* tensor occupies nothing
there. So with ``peak_without`` the forward/backward peak with no
offloadable tensor on the device and ``step_floor`` the device memory the step needs:

* ZeRO-1/2 reload every offloaded tensor for the step, so there ``step_floor`` is the step's other
  memory plus all offloadable bytes; ZeRO-3 streams its step in sub-groups (zero/sub_groups.py),
  so there ``step_floor`` is the other memory plus the two largest consecutive sub-groups' state,
  and resident tensors are counted against the step as well as the forward/backward;
* the smallest plan (everything offloaded) needs ``max(peak_without, step_floor)``; a budget below
  that cannot be met by any plan (:class:`OffloadBudgetError`, which names the minimum);
* otherwise at most ``budget - peak_without`` bytes (streamed: ``budget - max(peak_without,
  step_floor)``) may stay resident, and the plan offloads the
  fewest bytes that bring the resident total under that, greedily: the largest tensors first (few,
  large, efficient transfers) until the smallest tensor that alone covers what is still missing
  completes the plan (so it does not overshoot by a whole large tensor).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence


class OffloadBudgetError(ValueError):
    """The memory budget is below what the smallest offload plan needs."""


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    offloaded: List[bool]  # per tensor, in the order given
    resident_bytes: int
    offloaded_bytes: int
    required_bytes: int  # the least the plan had to offload (budget and ratio)


def plan_offload(sizes: Sequence[int], keep_limit: Optional[int], min_fraction: float,
                 forced: Optional[Sequence[bool]] = None, eligible: Optional[Sequence[bool]] = None,
                 priority: Optional[Sequence[int]] = None) -> OffloadPlan:
    """Choose the tensors to offload among ``sizes`` (bytes each).

    ``keep_limit``: the most bytes that may stay resident (None: no budget, offload everything
    eligible). ``min_fraction``: the least fraction of the eligible bytes to offload whatever the
    budget (``offload_optimizer.ratio``; 0 for ``compile.offload_opt_states`` alone).
    ``forced``: tensors offloaded whatever the budget (``offload_param``'s master shards); their
    bytes count towards what the budget requires. ``eligible``: tensors of an offload kind that is
    on (default: all). ``priority``: lower goes first (default: all equal): optimizer state, moved
    once each way per step, before ZeRO-3 master shards, which every gather also reads.
    """
    n = len(sizes)
    forced = [bool(f) for f in forced] if forced is not None else [False] * n
    eligible = [bool(e) or f for e, f in zip(eligible, forced)] if eligible is not None else [True] * n
    priority = list(priority) if priority is not None else [0] * n
    total = sum(sizes)
    movable = sum(size for size, e in zip(sizes, eligible) if e)
    if keep_limit is None:
        required = movable
    else:
        required = max(total - max(keep_limit, 0), math.ceil(min_fraction * movable))
        if required > movable:
            raise OffloadBudgetError(
                f"offload: the memory budget leaves {max(keep_limit, 0)} bytes for offloadable tensors, but "
                f"{total - movable} bytes of them belong to an offload kind that is off; turn it on "
                "(compile.offload_opt_states / compile.offload_parameters) or raise the budget")
    offloaded = list(forced)
    moved = sum(size for size, out in zip(sizes, offloaded) if out)
    # Stable orders: among equal sizes the given order (the reload order) decides.
    order = sorted(range(n), key=lambda i: (priority[i], -sizes[i]))
    while moved < required:
        missing = required - moved
        left = [i for i in order if eligible[i] and not offloaded[i]]
        first = priority[left[0]]
        left = [i for i in left if priority[i] == first]  # a later class only once this one is out
        # The smallest tensor that alone completes the plan, else the largest (and go on).
        finishing = [i for i in left if sizes[i] >= missing]
        pick = min(finishing, key=lambda i: (sizes[i], i)) if finishing else left[0]
        offloaded[pick] = True
        moved += sizes[pick]
    return OffloadPlan(offloaded, total - moved, moved, required)


def check_budget(budget: Optional[int], budget_name: str, peak_without: int, step_floor: int) -> None:
    """Raise :class:`OffloadBudgetError` when no plan fits ``budget``."""
    if budget is None:
        return
    minimum = max(peak_without, step_floor)
    if budget < minimum:
        raise OffloadBudgetError(
            f"optimizer-state offload: the memory budget ({budget_name} = {budget} bytes) is smaller than the smallest "
            f"plan, which needs {minimum} bytes on the device even with all offloadable optimizer state on the host "
            f"(forward/backward peak without it: {peak_without} bytes; the optimizer step, which reloads all of it: "
            f"{step_floor} bytes). Raise the budget to at least {minimum} bytes, or reduce the batch or the model")
