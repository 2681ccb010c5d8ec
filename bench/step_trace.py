"""Where a training step's time goes: a torch.profiler summary of a few steps, as small text.

Used by ``train_bench.py --trace DIR``: after a method's measured steps, ``trace_steps`` runs
``steps`` more under ``torch.profiler`` and rank 0 writes ``DIR/<method key>.txt`` holding

* a breakdown of device time by kind: NCCL kernels, other kernels, memory copies/sets, against
  the wall time of the traced steps (device time above the wall time means streams overlapped;
  far below means the GPU waited, e.g. for the host);
* the top operators by self CPU time (host overhead: dispatcher, runtime ops, Python);
* the top operators and kernels by device time;
* how communication overlaps computation: the time some compute kernel runs, the time some NCCL
  kernel runs, and the NCCL time with no compute kernel running at all (communication the step
  waits for: exposed), against the wall time;
* host-device transfers (offload): per direction (H2D, D2H) the time some copy of that direction
  runs, how much of it some kernel on another stream runs alongside (hidden behind compute), and
  the bytes moved, per step (``transfer_overlap``, from the Chrome trace's ``gpu_memcpy`` and
  ``kernel`` events with their streams).

Next to it, for a closer look offline, ``DIR/<method key>.trace.json.gz`` (the Chrome trace,
gzipped: a few MiB instead of tens) and ``DIR/<method key>.memory.pickle.gz`` (the allocator's
history of the traced steps with Python stacks, for ``torch.cuda.memory._snapshot`` tools or
``bench/memory_peak.py``).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch


def _device_time_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def _kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl kernels"
    if "memcpy" in low or "memset" in low:
        return "memcpy/memset"
    return "other kernels"


def _union_us(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Merge [start, end) intervals into disjoint ones, sorted."""
    merged: List[Tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: List[Tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection_length(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> float:
    """Total overlap of two disjoint, sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_lines(kernels: List[Tuple[str, float, float]], wall_ms: float, steps: int) -> List[str]:
    """Busy time of compute and NCCL kernels (each a union over all streams) and the NCCL time
    no compute kernel hides, from (name, start_us, end_us) of every device kernel."""
    nccl = _union_us([(s, e) for name, s, e in kernels if "nccl" in name.lower()])
    compute = _union_us([(s, e) for name, s, e in kernels if "nccl" not in name.lower()])
    per = max(steps, 1)
    compute_ms, nccl_ms = _length(compute) / 1e3, _length(nccl) / 1e3
    exposed_ms = nccl_ms - _intersection_length(nccl, compute) / 1e3
    idle_ms = wall_ms - _length(_union_us(nccl + compute)) / 1e3
    return [
        f"compute kernels busy: {compute_ms / per:.1f} ms/step ({100 * compute_ms / wall_ms:.0f} % of wall)",
        f"nccl kernels busy:    {nccl_ms / per:.1f} ms/step",
        f"nccl with no compute running (exposed): {exposed_ms / per:.1f} ms/step",
        f"no kernel running at all (host-bound or waiting): {idle_ms / per:.1f} ms/step",
    ]


@dataclasses.dataclass
class Transfers:
    """One copy direction over the traced steps (times in us, totals over all traced steps)."""

    busy_us: float = 0.0  # union of the direction's copy intervals
    hidden_us: float = 0.0  # part of busy_us during which a kernel on another stream runs
    nbytes: int = 0
    copies: int = 0


def _clip(interval: Tuple[float, float], union: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The pieces of ``interval`` covered by the disjoint, sorted ``union``."""
    start, end = interval
    return [(max(start, s), min(end, e)) for s, e in union if s < end and e > start]


def transfer_overlap(copies: List[Tuple[str, object, float, float, int]],
                     kernels: List[Tuple[object, float, float]]) -> Dict[str, Transfers]:
    """Per direction of ``copies`` (direction, stream, start, end, bytes): the time some copy of
    that direction runs (copies overlapping each other count once) and how much of it is hidden,
    i.e. covered by some kernel of ``kernels`` (stream, start, end) that runs on another stream
    than the copy (a kernel on the copy's own stream cannot run alongside it)."""
    by_stream: Dict[object, List[Tuple[float, float]]] = {}
    for stream, start, end in kernels:
        by_stream.setdefault(stream, []).append((start, end))
    others: Dict[object, List[Tuple[float, float]]] = {}
    out: Dict[str, Transfers] = {}
    pieces: Dict[str, Tuple[List[Tuple[float, float]], List[Tuple[float, float]]]] = {}
    for direction, stream, start, end, nbytes in copies:
        if stream not in others:
            others[stream] = _union_us([iv for s, ivs in by_stream.items() if s != stream for iv in ivs])
        spans, hidden = pieces.setdefault(direction, ([], []))
        spans.append((start, end))
        hidden.extend(_clip((start, end), others[stream]))
        t = out.setdefault(direction, Transfers())
        t.nbytes += int(nbytes)
        t.copies += 1
    for direction, (spans, hidden) in pieces.items():
        out[direction].busy_us = _length(_union_us(spans))
        out[direction].hidden_us = _length(_union_us(hidden))
    return out


def copies_and_kernels(trace: dict) -> Tuple[List[Tuple[str, object, float, float, int]], List[Tuple[object, float, float]]]:
    """From a Chrome trace (``prof.export_chrome_trace``): the host-device copies as (``"H2D"`` or
    ``"D2H"``, stream, start_us, end_us, bytes) and the kernels as (stream, start_us, end_us).
    Device-to-device and peer copies are not PCIe transfers and are left out."""
    copies, kernels = [], []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat = str(ev.get("cat", "")).lower()
        args = ev.get("args") or {}
        start, end = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
        stream = args.get("stream", ev.get("tid"))  # kineto names the stream in args; its row (tid) is the stream too
        if cat == "kernel":
            kernels.append((stream, start, end))
        elif cat == "gpu_memcpy":
            name = str(ev.get("name", ""))
            direction = "H2D" if "HtoD" in name else "D2H" if "DtoH" in name else None
            if direction is not None:
                copies.append((direction, stream, start, end, int(args.get("bytes", 0) or 0)))
    return copies, kernels


def transfer_summary(transfers: Dict[str, Transfers], steps: int, wall_ms: float) -> Dict[str, float]:
    """Per-step numbers of the table: transfer and hidden ms per direction and together, GB moved."""
    per = max(steps, 1)
    out: Dict[str, float] = {"step_ms": wall_ms / per}
    for direction in ("H2D", "D2H"):
        t = transfers.get(direction, Transfers())
        key = direction.lower()
        out[f"{key}_ms"] = t.busy_us / 1e3 / per
        out[f"{key}_hidden_ms"] = t.hidden_us / 1e3 / per
        out[f"{key}_gb"] = t.nbytes / 1e9 / per
    out["transfer_ms"] = out["h2d_ms"] + out["d2h_ms"]
    out["hidden_ms"] = out["h2d_hidden_ms"] + out["d2h_hidden_ms"]
    return out


def transfer_lines(summary: Dict[str, float]) -> List[str]:
    lines = []
    for direction in ("H2D", "D2H"):
        key = direction.lower()
        busy, hidden = summary[f"{key}_ms"], summary[f"{key}_hidden_ms"]
        pct = f"{100 * hidden / busy:.0f} %" if busy else "-"
        lines.append(f"{direction} copies busy: {busy:.1f} ms/step, hidden behind kernels on other streams "
                     f"{hidden:.1f} ms ({pct}), {summary[f'{key}_gb']:.2f} GB/step")
    return lines


def generated_kernel_line(kernels: List[Tuple[str, float, float]], steps: int) -> str:
    """Launches and time of the kernels Inductor generated (Triton's ``triton_*``): more launches
    for the same model means fusion regions were split."""
    generated = [(s, e) for name, s, e in kernels if name.startswith("triton_")]
    per = max(steps, 1)
    return (f"inductor-generated kernels: {len(generated) / per:.0f} launches/step, "
            f"{sum(e - s for s, e in generated) / 1e3 / per:.1f} ms/step")


def record_memory_steps(step: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[torch.Tensor],
                        sync: Callable[[], None], path: str, write: bool, stacks: str = "python") -> None:
    """The steps under the allocator's history alone (no ``torch.profiler``), written to ``path``
    + ``.memory.pickle.gz``. ``stacks``: "python", "all" (Python and C++) or "none" (sizes and
    order only: Python stacks make the recompute of a compiled region inside checkpoint fail,
    NOTES.md)."""
    sync()
    record = torch.cuda.is_available() and write
    if record:
        if stacks == "none":
            torch.cuda.memory._record_memory_history(max_entries=200_000, context=None)
        else:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks=stacks)
    try:
        for tokens in batches:
            step(tokens)
        sync()
        if record:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            _write_gzipped(path + ".memory.pickle", torch.cuda.memory._dump_snapshot)
    finally:
        if record:
            torch.cuda.memory._record_memory_history(enabled=None)


def trace_steps(step: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[torch.Tensor], sync: Callable[[], None],
                path: str, title: str, write: bool, record_memory: bool = True) -> Optional[Dict[str, float]]:
    """Profile the steps; on the writing rank, write the summary and return ``transfer_summary``."""
    batches = list(batches)
    tracer = StepTracer(sync, path, title, write, record_memory)
    tracer.start()
    for tokens in batches:
        step(tokens)
    return tracer.stop(len(batches))


class StepTracer:
    """A profiler window opened and closed by whoever drives the steps (``trace_steps`` above, or a
    Trainer callback in trainer_bench.py, where the loop is not ours)."""

    def __init__(self, sync: Callable[[], None], path: str, title: str, write: bool, record_memory: bool = True):
        self.sync, self.path, self.title, self.write = sync, path, title, write
        self.record_memory = record_memory and torch.cuda.is_available() and write
        self.prof = None
        self.start_s = 0.0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.sync()
        if self.record_memory:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.start_s = time.perf_counter()

    def stop(self, n_steps: int) -> Optional[Dict[str, float]]:
        """Close the window after ``n_steps`` steps; on the writing rank, write the summary."""
        self.sync()
        wall_ms = (time.perf_counter() - self.start_s) * 1e3
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        if not self.write:
            return None
        return write_summary(prof, wall_ms, n_steps, self.path, self.title, self.record_memory)


def write_summary(prof, wall_ms: float, n_steps: int, path: str, title: str,
                  record_memory: bool) -> Dict[str, float]:
    """The text summary (and the gzipped Chrome trace and allocator history) of a closed profiler."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    stem = path[: -len(".txt")] if path.endswith(".txt") else path
    if record_memory:
        _write_gzipped(stem + ".memory.pickle", torch.cuda.memory._dump_snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    chrome: dict = {}
    _write_gzipped(stem + ".trace.json", prof.export_chrome_trace, lambda p: chrome.update(_read_json(p)))
    transfers = transfer_summary(transfer_overlap(*copies_and_kernels(chrome)), n_steps, wall_ms)
    kernels = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
               if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")]
    kinds = {"nccl kernels": 0.0, "other kernels": 0.0, "memcpy/memset": 0.0}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kinds[_kind(e.name)] += _device_time_us(e) / 1e3
    sort_device = "self_device_time_total" if hasattr(prof.key_averages()[0], "self_device_time_total") \
        else "self_cuda_time_total"
    per = max(n_steps, 1)
    lines = [f"# {title}: {n_steps} traced step(s), wall {wall_ms:.1f} ms ({wall_ms / per:.1f} ms/step)", ""]
    lines += [f"device time, {k}: {v:.1f} ms ({v / per:.1f} ms/step)" for k, v in kinds.items()]
    lines += [generated_kernel_line(kernels, n_steps)]
    lines += [""] + overlap_lines(kernels, wall_ms, n_steps)
    lines += [""] + transfer_lines(transfers)
    # The step-time account (bench/step_account.py): by kind of kernel, idle device, host launches.
    from step_account import account, table

    lines += ["", "## step-time account", table([(title, account(chrome, n_steps))])]
    lines += ["", "## top operators by self CPU time",
              prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)]
    if torch.cuda.is_available():
        lines += ["", "## top operators and kernels by self device time",
                  prof.key_averages().table(sort_by=sort_device, row_limit=25, max_name_column_width=60)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return transfers


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_gzipped(path: str, write: Callable[[str], None], read: Optional[Callable[[str], None]] = None) -> None:
    """``write(path)``, ``read(path)`` if given, then gzip the file in place (``path + ".gz"``)."""
    write(path)
    if read is not None:
        read(path)
    with open(path, "rb") as raw, gzip.open(path + ".gz", "wb", compresslevel=6) as packed:
        shutil.copyfileobj(raw, packed)
    os.remove(path)
