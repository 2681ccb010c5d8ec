"""The pass schedule: which optional passes apply from which optimizer step on.

The ZeRO pass of the engine's stage always runs. On top of it, ZeRO-3 has two optional,
profile-guided passes:

* ``prefetch``: fused all-gathers launched ahead of their use, within the memory budget;
* ``selective_gather``: selective unsharding, parameters kept gathered within the memory budget.

A schedule is a list of entries ``(step, passes)``. The entry in force at optimizer step ``s`` is
the last one with ``entry.step <= s`` (none: no optional pass). Matching on ``>=`` rather than
equality makes it resume-safe: an engine whose ``global_steps`` starts past an entry (a resumed
run) still gets that entry, and a schedule without a step-0 entry simply starts plain.

The default, from the ``compile`` config block: plain ZeRO-3 until ``warmup_steps``, then
``prefetch`` and ``selective_gather`` as enabled by their switches. ``compile.schedule`` replaces
it with an explicit list, e.g. ``[{"step": 0, "passes": []}, {"step": 3, "passes": ["prefetch"]}]``.
"""

from __future__ import annotations

import dataclasses
from typing import FrozenSet, Iterable, List, Optional

# The pass names are the config's vocabulary (compile.schedule, compile.prefetch / selective_gather).
from deepcompile.config.compile_section import PASS_NAMES
from deepcompile.config.rules import optional_passes


@dataclasses.dataclass(frozen=True)
class ScheduleEntry:
    step: int
    passes: FrozenSet[str]

    def describe(self) -> str:
        return f"step {self.step}: " + (", ".join(sorted(self.passes)) or "plain")


PLAIN = ScheduleEntry(0, frozenset())


class PassSchedule:
    def __init__(self, entries: Iterable[ScheduleEntry]):
        self.entries: List[ScheduleEntry] = sorted(entries, key=lambda e: e.step)
        steps = [e.step for e in self.entries]
        if len(set(steps)) != len(steps):
            raise ValueError(f"pass schedule: two entries for the same step in {steps}")
        for e in self.entries:
            unknown = set(e.passes) - set(PASS_NAMES)
            if unknown:
                raise ValueError(f"pass schedule: unknown pass(es) {sorted(unknown)}; known: {list(PASS_NAMES)}")

    @classmethod
    def from_config(cls, config) -> "PassSchedule":
        """The schedule of an engine's :class:`deepcompile.Config` (empty below ZeRO-3)."""
        if config.zero_optimization.stage != 3:
            return cls([])
        c = config.compile
        if c.schedule is not None:
            return cls(ScheduleEntry(e["step"], frozenset(e["passes"])) for e in c.schedule)
        passes = optional_passes(config)  # compile.prefetch / selective_gather, and DeepSpeed's limits at 0
        if not passes:
            return cls([])
        if c.warmup_steps == 0:
            return cls([ScheduleEntry(0, passes)])
        return cls([ScheduleEntry(0, frozenset()), ScheduleEntry(c.warmup_steps, passes)])

    def entry_at(self, step: int) -> ScheduleEntry:
        """The entry in force at optimizer step ``step``."""
        current = PLAIN
        for e in self.entries:
            if e.step <= step:
                current = e
        return current

    def next_after(self, step: int) -> Optional[ScheduleEntry]:
        return next((e for e in self.entries if e.step > step), None)


def needs_profile(entry: ScheduleEntry) -> bool:
    """Every optional pass plans from a profile of the graphs it changes."""
    return bool(entry.passes)
