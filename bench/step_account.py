"""The step-time account: where one training step's time goes, by what the GPU runs and what the
host does, from the Chrome traces ``--trace`` writes (bench/step_trace.py), side by side.

    python bench/step_account.py TRACE[:STEPS] [TRACE[:STEPS] ...]

Each TRACE is a ``<row>.trace.json.gz`` (train_bench.py or trainer_bench.py with ``--trace DIR``);
STEPS is the number of traced steps (default 2, the benches' ``--trace-steps``). Columns are the
traces, rows are ms per step:

* device time by kind of kernel (summed over streams, so kinds that overlap can add up to more
  than the step): GEMMs (cuBLAS/CUTLASS/nvjet), attention (flash, memory-efficient, cuDNN SDPA),
  the optimizer (multi-tensor and fused Adam kernels), collectives (NCCL), copies and sets,
  Inductor's generated kernels (``triton_*``) and everything else;
* the device's busy time (the union of all of them) and its idle time (the traced span minus that
  union: the host did not keep the GPU fed, or the GPU waited on something outside it);
* the host: kernel launches per step, the time in CUDA's launch calls, and in deepcompile's own
  runtime ops (``dc::``).

The classification is by kernel name; `classify` says which names fall where.
"""

from __future__ import annotations

import gzip
import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

KINDS = ("GEMM", "attention", "optimizer", "collectives", "copies/sets", "inductor fused", "other")
_GEMM = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_", "ampere_", "hopper_")
_ATTENTION = ("flash", "fmha", "attention", "efficient_attention", "cudnn_sdpa", "sdpa")
_OPTIMIZER = ("multi_tensor", "adam", "foreach", "fused_sgd")  # not "lamb": it would match "lambda"


def classify(name: str, category: str = "kernel") -> str:
    """The kind of a device event, from its name (``category``: the trace's ``cat``)."""
    low = name.lower()
    if category in ("gpu_memcpy", "gpu_memset") or "memcpy" in low or "memset" in low:
        return "copies/sets"
    if "nccl" in low:
        return "collectives"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if any(k in low for k in _OPTIMIZER):
        return "optimizer"
    if any(k in low for k in _GEMM):
        return "GEMM"
    if low.startswith("triton_"):
        return "inductor fused"
    return "other"


def _union_length(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def account(trace: dict, steps: int) -> Dict[str, float]:
    """ms per step by row (the module's list) from one Chrome trace of ``steps`` steps."""
    per = max(steps, 1)
    by_kind = dict.fromkeys(KINDS, 0.0)
    device: List[Tuple[float, float]] = []
    span: List[float] = []
    launches, launch_us, dc_us = 0, 0.0, 0.0
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        start, dur = float(ev["ts"]), float(ev["dur"])
        span += [start, start + dur]
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_kind[classify(name, cat)] += dur
            device.append((start, start + dur))
        elif cat == "cuda_runtime" and "launch" in name.lower():
            launches += 1
            launch_us += dur
        elif cat == "cpu_op" and name.startswith("dc::"):
            dc_us += dur
    out = {f"device: {kind}": us / 1e3 / per for kind, us in by_kind.items()}
    busy = _union_length(device)
    traced = (max(span) - min(span)) if span else 0.0
    out["device busy (union)"] = busy / 1e3 / per
    out["device idle"] = max(traced - busy, 0.0) / 1e3 / per
    out["traced span"] = traced / 1e3 / per
    out["host: kernel launches (count)"] = launches / per
    out["host: in launch calls"] = launch_us / 1e3 / per
    out["host: in dc:: runtime ops"] = dc_us / 1e3 / per
    return out


def table(columns: Sequence[Tuple[str, Dict[str, float]]]) -> str:
    """The accounts side by side, one column per trace."""
    rows = list(columns[0][1]) if columns else []
    width = max([len(r) for r in rows] + [10])
    head = "ms per step".ljust(width) + "".join(f"  {name[-24:]:>24}" for name, _ in columns)
    lines = [head]
    for row in rows:
        fmt = "{:>24.0f}" if "(count)" in row else "{:>24.2f}"
        lines.append(row.ljust(width) + "".join("  " + fmt.format(acc[row]) for _, acc in columns))
    return "\n".join(lines)


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    columns = []
    for arg in args:
        path, sep, steps = arg.rpartition(":")
        if not sep or not steps.isdigit():
            path, steps = arg, ""
        name = path.rsplit("/", 1)[-1].replace(".trace.json.gz", "").replace(".trace.json", "")
        columns.append((name, account(load(path), int(steps) if steps else 2)))
    print(table(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
