"""The schedule report's ``sizes`` section: what DeepSpeed's three size keys became in this run.

HF Trainer and accelerate fill ``reduce_bucket_size``, ``stage3_prefetch_bucket_size`` and
``stage3_param_persistence_threshold`` from the model's hidden size when the config says
``"auto"`` (h*h, 0.9*h*h, 10*h); deepcompile fills them the same way when it is handed ``"auto"``
(config/auto.py). Each keeps DeepSpeed's meaning, in elements:

* ``reduce_bucket_size``: gradients are reduced in buckets of at most this many elements (the
  runtime's reduce buckets; double-buffered unless ``overlap_comm`` is false);
* ``stage3_prefetch_bucket_size``: the largest fused all-gather the prefetch pass forms (a
  parameter larger than it is gathered alone); the profile-guided planner fuses only gathers that
  are latency-bound, so on large models it rarely reaches this cap;
* ``stage3_param_persistence_threshold``: a ZeRO-3 parameter of fewer elements stays gathered for
  the whole run (no gather or release at all).

The section states the values and what they produced (buckets, persistent parameters), so a user
can see what a Trainer-filled ``"auto"`` turned into.
"""

from __future__ import annotations

from typing import Any, Dict, List

from deepcompile import runtime


class SizesReport:
    """A schedule report contributor (scheduling/report.py): adds ``sizes``."""

    name = "sizes"

    def __init__(self, zero_config: Any, stage: int, persistent: List[int], persistent_numel: int):
        self.zero = zero_config
        self.stage = stage
        self.persistent, self.persistent_numel = persistent, persistent_numel

    def sizes(self) -> Dict[str, Any]:
        z = self.zero
        out: Dict[str, Any] = {
            "reduce_bucket_size": {"elements": int(z.reduce_bucket_size),
                                   "became": f"gradient reduce buckets of {runtime.reduce_bucket_numel():,} elements"},
        }
        if self.stage == 3:
            out["stage3_prefetch_bucket_size"] = {
                "elements": int(z.stage3_prefetch_bucket_size),
                "became": "the largest fused all-gather of the prefetch pass"}
            out["stage3_param_persistence_threshold"] = {
                "elements": int(z.stage3_param_persistence_threshold),
                "became": f"{len(self.persistent)} parameter(s) ({self.persistent_numel:,} elements) gathered for the "
                          "whole run"}
        return out

    def report(self, into: Dict[str, Any]) -> None:
        into["sizes"] = self.sizes()

