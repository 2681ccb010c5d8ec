"""Whether a tiled pass (``compile.tiled_loss``, ``compile.tiled_mlp``) replaces a given site.

``true`` replaces every site the pass can tile. ``"planned"`` leaves the choice to the memory
budget (memory/budget.py): a site is tiled when the bytes tiling keeps from being held, counted
from the traced shapes, exceed :data:`PLANNED_SHARE` of the budget; the rest run as the model
computes them, at no extra cost. At short sequences nothing is tiled; at long ones the logits and
the MLPs' intermediates are (2 % of an H200's default budget is 2.5 GiB: in bf16 a 1B Llama's
MLP is tiled from about 60k tokens per rank, an 8B's from 24k, and a 128k-word vocabulary's loss
from 2.1k tokens).
Without a budget (a CPU device without ``compile.memory_budget_bytes``) nothing is tiled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

PLANNED = "planned"
PLANNED_SHARE = 0.02


@dataclasses.dataclass
class TilingChoice:
    """``mode``: True (every site) or PLANNED (the budget decides); ``budget_bytes``: the memory
    budget, None for none. Counts what it decided, for the reports and the engine's checks."""

    mode: Any
    budget_bytes: Optional[int] = None
    tiled: int = 0
    left: int = 0  # sites left untiled by the plan

    @property
    def planned(self) -> bool:
        return self.mode == PLANNED

    def threshold(self) -> Optional[int]:
        """Bytes above which a site is tiled; None: never (planned without a budget)."""
        if not self.planned:
            return 0
        return None if self.budget_bytes is None else int(self.budget_bytes * PLANNED_SHARE)

    def wants(self, removable_bytes: int) -> bool:
        """Whether to tile a site whose tiling keeps ``removable_bytes`` from being held."""
        limit = self.threshold()
        chosen = limit is not None and removable_bytes > limit
        if chosen:
            self.tiled += 1
        else:
            self.left += 1
        return chosen
