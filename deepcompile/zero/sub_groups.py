"""ZeRO-3's optimizer step in sub-groups (``zero_optimization.sub_group_size``).

DeepSpeed steps ZeRO-3's optimizer over *sub-groups* of at most ``sub_group_size`` master elements
at a time. Here it serves two purposes:

* the step's transient memory is one sub-group's: a ``foreach`` optimizer allocates temporaries
  for every tensor it updates at once, and each sub-group's gradient partitions are dropped as soon
  as it has stepped, so the step's peak is no longer "all masters + all gradients + all optimizer
  state + temporaries for everything";
* optimizer-state offload streams the step sub-group by sub-group (``offload/opt_states.py``): the
  next sub-group's state is reloaded while this one steps, and this one's is written back while
  the next one steps, so at most a window of state is on the device at once.

Sub-groups are consecutive in *reverse* registration order: the parameters registered last are
used last in the forward, so their gradients are final first in the backward and their state is
the first to come back. A parameter larger than ``sub_group_size`` forms a sub-group of its own.

Stepping a subset of a torch optimizer's parameters is a plain ``optimizer.step()`` with only that
subset's ``.grad`` set (torch optimizers skip parameters without a gradient): every parameter is
stepped exactly once per optimizer step, and its update is bitwise what one step over everything
computes (the element-wise arithmetic does not depend on which tensors share a ``foreach`` call).
The user's step hooks (``register_step_pre_hook``/``post_hook``) run once per sub-group.
"""

from __future__ import annotations

from typing import List, Protocol, Sequence, Tuple

# DeepSpeed's default sub_group_size (elements).
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


def split_sub_groups(sizes: Sequence[Tuple[int, int]], sub_group_size: int) -> List[List[int]]:
    """``sizes``: (ds id, elements) in registration order. Returns the sub-groups, lists of ds ids
    in stepping order (reverse registration order), each at most ``sub_group_size`` elements
    unless a single parameter is larger."""
    if sub_group_size < 1:
        raise ValueError(f"sub_group_size must be at least 1, got {sub_group_size}")
    groups: List[List[int]] = []
    current: List[int] = []
    filled = 0
    for ds_id, n in reversed(list(sizes)):
        if current and filled + n > sub_group_size:
            groups.append(current)
            current, filled = [], 0
        current.append(ds_id)
        filled += n
    if current:
        groups.append(current)
    return groups


class SubGroupHooks(Protocol):
    """What the step calls around each sub-group (optimizer-state offload implements it)."""

    def before_sub_group(self, index: int, groups: List[List[int]]) -> None:
        """The state of ``groups[index]`` must be on the device (and ordered before the compute
        stream's next work) when this returns; may start bringing later sub-groups back."""

    def after_sub_group(self, index: int, groups: List[List[int]]) -> None:
        """``groups[index]`` has stepped; its state may leave the device."""
