"""``steps_per_print`` and ``wall_clock_breakdown``: what rank 0 logs about the training loop.

Every ``steps_per_print`` optimizer steps rank 0 logs the step number and the learning rates to the
``deepcompile`` logger at INFO level (configure ``logging`` to see it). With
``wall_clock_breakdown`` the engine also times its forward, backward and optimizer step, each
between two device synchronizations (otherwise asynchronous CUDA work would be charged to whatever
waits next), and the same log line gives the mean milliseconds per optimizer step of each phase
since the previous report. Without it nothing is timed and nothing is synchronized.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

import torch

log = logging.getLogger("deepcompile")

PHASES = ("forward", "backward", "step")


class StepReport:
    def __init__(self, steps_per_print: int, wall_clock_breakdown: bool, rank: int, device: torch.device):
        self.every = steps_per_print
        self.timing = wall_clock_breakdown
        self.rank = rank
        self.device = device
        self._started: Dict[str, float] = {}
        self.totals_ms: Dict[str, float] = {p: 0.0 for p in PHASES}
        self._steps_in_window = 0
        self.last_line: Optional[str] = None  # the last line logged (tests read it)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self, phase: str) -> None:
        if self.timing:
            self._sync()
            self._started[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.timing and phase in self._started:
            self._sync()
            self.totals_ms[phase] += (time.perf_counter() - self._started.pop(phase)) * 1e3

    def after_optimizer_step(self, global_step: int, lrs: List[float]) -> None:
        """Called once per optimizer step with the new step count and the learning rates."""
        self._steps_in_window += 1
        if global_step % self.every:
            return
        line = f"step {global_step}: lr {', '.join(f'{lr:.6g}' for lr in lrs)}"
        if self.timing:
            n = self._steps_in_window
            line += " | ms per step: " + " | ".join(f"{p} {self.totals_ms[p] / n:.2f}" for p in PHASES)
            self.totals_ms = {p: 0.0 for p in PHASES}
        self._steps_in_window = 0
        if self.rank == 0:
            self.last_line = line
            log.info(line)
