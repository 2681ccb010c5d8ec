"""What is alive at the peak: reads an allocator history written by ``train_bench.py --trace``
(``<method>.memory.pickle.gz``) and prints, for the traced steps, where the peak of allocated
memory falls and the allocations alive there, largest groups first.

    python3 bench/memory_peak.py traces/z3-prefetch.memory.pickle.gz [--top 25]

Allocations made before the history started (parameters, optimizer state) show as one
"before the trace" baseline; everything else is grouped by the first stack frame outside torch's
own Python files (for Inductor code: the generated kernel file and line), and by size.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import pickle
from typing import Dict, List, Tuple

GIB = 1024**3
_TORCH_INTERNAL = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def where(frames: List[dict]) -> str:
    """The first frame outside torch internals (the innermost if all are internal)."""
    for frame in frames:
        if not any(part in frame.get("filename", "") for part in _TORCH_INTERNAL):
            return f"{frame.get('filename', '?').rsplit('/', 1)[-1]}:{frame.get('line', '?')} {frame.get('name', '')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '')}"
    return "(no stack)"


def live_bytes_at_end(snapshot: dict, device: int) -> int:
    return sum(block["size"] for seg in snapshot["segments"] if seg["device"] == device
               for block in seg["blocks"] if block["state"] == "active_allocated")


def peak(snapshot: dict, device: int = 0) -> Tuple[int, int, Dict[int, dict]]:
    """(baseline bytes, peak bytes, live allocations at the peak by address)."""
    events = snapshot["device_traces"][device]
    live: Dict[int, dict] = {}
    running = best = 0
    best_live: Dict[int, dict] = {}
    for event in events:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            running += event["size"]
            if running > best:
                best, best_live = running, dict(live)
        elif action == "free_completed":
            if event["addr"] in live:
                running -= live.pop(event["addr"])["size"]
            else:  # allocated before the history started
                running -= event["size"]
    baseline = live_bytes_at_end(snapshot, device) - running
    return baseline, baseline + best, best_live


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    snapshot = load(args.path)
    baseline, top, live = peak(snapshot, args.device)
    print(f"peak allocated {top / GIB:.2f} GiB = before the trace {baseline / GIB:.2f} GiB "
          f"+ {(top - baseline) / GIB:.2f} GiB allocated during the trace, alive at the peak:")
    groups: Dict[Tuple[str, int], List[int]] = collections.defaultdict(list)
    for event in live.values():
        groups[(where(event.get("frames", [])), event["size"])].append(event["size"])
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    for (site, size), sizes in rows[: args.top]:
        print(f"  {sum(sizes) / 2**20:9.1f} MiB  {len(sizes):4d} x {size / 2**20:8.2f} MiB  {site}")
    rest = sum(sum(v) for _, v in rows[args.top:])
    if rest:
        print(f"  {rest / 2**20:9.1f} MiB  in {len(rows) - args.top} smaller groups")


if __name__ == "__main__":
    main()
