"""Optimizer-state offload: deepcompile ZeRO-3 with and without it, against FSDP2 + CPU offload.

    torchrun --nproc-per-node 1 bench/offload_bench.py [--methods z3,z3-offload,...] [train_bench options]

One GPU, a Llama that fits without offload (default: hidden 2048, 8 layers, seq 1024, micro-batch
2; about 0.55 B parameters), so every row runs and the rows show what offload costs and saves:

* ``deepcompile ZeRO-3`` (``z3``): everything on the device;
* ``deepcompile ZeRO-3 + offload_optimizer`` (``z3-offload``): ``offload_optimizer: {"device":
  "cpu", "pin_memory": true}``: all Adam state on the host between steps, reloaded for the step;
* ``deepcompile ZeRO-3 + offload_opt_states, budget`` (``z3-offload-budget``):
  ``compile.offload_opt_states`` under ``--offload-budget-gib`` (default: the measured peak of
  ``z3`` minus half the Adam state, so the planner has to offload about half of it);
* ``FSDP2 + CPU offload + compile`` (``fsdp2-offload``): the peer: ``fully_shard`` per decoder
  layer and the root with ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the
  optimizer step on the host), ``MixedPrecisionPolicy(bf16, fp32)``, then ``torch.compile``.

The rows are train_bench.py's own (``--methods`` keys of the same names; its docstring says how each
row and column is taken); this script is a preset: the smaller model, these four rows, and the
budget of ``z3-offload-budget`` taken from the ``z3`` row's measured peak unless
``--offload-budget-gib`` is given. For the issue's 7B model use ``train_bench.py --preset 7b``.

About 4-5 minutes on one H100 with the defaults (three compiles of the 8-layer model dominate).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_bench as tb  # noqa: E402  (bench/ is not a package)

GIB = 1024**3
OFFLOAD_DEFAULTS = ["--hidden", "2048", "--layers", "8", "--heads", "16", "--intermediate", "5632", "--seq", "1024",
                    "--micro-batch", "2", "--warmup", "3", "--steps", "5",
                    "--methods", "z3,z3-offload,z3-offload-budget,fsdp2-offload"]
# Set from the z3 row when --offload-budget-gib is not given.
_measured = {"z3_peak": None}
_budget_gib: Optional[float] = None


def _adam_bytes(ctx: tb.Context) -> int:
    """fp32 exp_avg + exp_avg_sq of this rank's shards."""
    return 2 * 4 * -(-ctx.n_params // ctx.world)


def z3_runner(ctx: tb.Context) -> tb.Runner:
    """train_bench's z3 row, remembering its peak for the budget row."""
    runner = tb.deepcompile_runner(ctx, stage=3)
    inner = runner.note

    def note() -> str:
        if ctx.is_cuda:
            _measured["z3_peak"] = torch.cuda.max_memory_allocated(ctx.device)
        return inner()

    return dataclasses.replace(runner, note=note)


def budget_runner(ctx: tb.Context) -> tb.Runner:
    """z3-offload-budget under a budget that forces the planner to offload about half the Adam state."""
    budget = _budget_gib
    if budget is None:
        if _measured["z3_peak"] is None:
            raise tb.Unavailable("needs --offload-budget-gib or the z3 row before it")
        budget = (_measured["z3_peak"] - _adam_bytes(ctx) // 2) / GIB
    return tb.deepcompile_runner(ctx, 3, tb.OFFLOAD_PASSES[ctx.args.offload_passes], "budget",
                                 budget_bytes=int(budget * GIB))


def main(argv: Optional[List[str]] = None) -> int:
    global _budget_gib
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--offload-budget-gib" in argv:
        i = argv.index("--offload-budget-gib")
        _budget_gib = float(argv[i + 1])
        del argv[i:i + 2]
    if "--isolate" in argv:
        raise SystemExit("offload_bench.py: its budget row needs the z3 row of the same process; use "
                         "--offload-budget-gib with train_bench.py --isolate instead")
    tb.METHODS["z3"] = dataclasses.replace(tb.METHODS["z3"], build=z3_runner)
    tb.METHODS["z3-offload-budget"] = dataclasses.replace(tb.METHODS["z3-offload-budget"], build=budget_runner)
    # The script's defaults first; options given on the command line override them.
    return tb.main(OFFLOAD_DEFAULTS + argv)


if __name__ == "__main__":
    sys.exit(main())
