"""What is alive at the peak: reads an allocator history written by ``train_bench.py --trace``
(``<method>.memory.pickle.gz``) and prints, for the traced steps, where the peak of allocated
memory falls and the allocations alive there, largest groups first.

    python3 bench/memory_peak.py traces/z3-prefetch.memory.pickle.gz [--top 25] [--timeline 40]

Allocations made before the history started (parameters, optimizer state) show as one
"before the trace" baseline; everything else is grouped by the first stack frame outside torch's
own Python files (for Inductor code: the generated kernel file and line, with the line's source
when the file is still there, i.e. when run on the machine that compiled it), and by size.
``--timeline K`` also prints the shape of the traced steps: the highest level within each of K
equal slices of the history and the allocation that reached it.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import linecache
import pickle
from typing import Dict, List, Tuple

GIB = 1024**3
_TORCH_INTERNAL = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def _describe(frame: dict) -> str:
    filename, line = frame.get("filename", "?"), frame.get("line", "?")
    text = f"{filename.rsplit('/', 1)[-1]}:{line} {frame.get('name', '')}"
    # Generated Inductor files are only named by a hash: the line itself says which op allocated.
    source = linecache.getline(filename, line).strip() if isinstance(line, int) else ""
    return f"{text}  | {source[:90]}" if source else text


def where(frames: List[dict]) -> str:
    """The first frame outside torch internals (the innermost if all are internal)."""
    for frame in frames:
        if not any(part in frame.get("filename", "") for part in _TORCH_INTERNAL):
            return _describe(frame)
    return _describe(frames[0]) if frames else "(no stack)"


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


def timeline(snapshot: dict, device: int, slices: int) -> List[Tuple[int, int, str]]:
    """(first event index, highest level in bytes above the baseline, site that reached it) per
    slice of the history; the level is relative to the start of the trace."""
    events = snapshot["device_traces"][device]
    size_of: Dict[int, int] = {}
    running = 0
    width = max(1, -(-len(events) // slices))
    rows: List[Tuple[int, int, str]] = []
    for start in range(0, len(events), width):
        best, site = running, "(the level the slice started at)"
        for event in events[start:start + width]:
            if event["action"] == "alloc":
                size_of[event["addr"]] = event["size"]
                running += event["size"]
                if running >= best:
                    best, site = running, where(event.get("frames", []))
            elif event["action"] == "free_completed":
                running -= size_of.pop(event["addr"], event["size"])
        rows.append((start, best, site))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--timeline", type=int, default=0, metavar="K", help="also print K slices of the history")
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
    if args.timeline:
        print(f"timeline: highest level per slice (GiB, including the {baseline / GIB:.2f} GiB baseline)")
        for start, level, site in timeline(snapshot, args.device, args.timeline):
            print(f"  event {start:7d}  {(baseline + level) / GIB:6.2f}  {site}")


if __name__ == "__main__":
    main()
