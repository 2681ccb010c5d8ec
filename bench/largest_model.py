"""The largest model that trains on this machine, per system: grow a 7B-shaped Llama's layer count
until training fails, and say why it failed.

    python3 bench/largest_model.py [--systems z3-offload-budget,fsdp2-offload,fsdp2,z3]
                                   [--layers 32,40,48,56,64] [--search linear|binary]
                                   [--timeout 300] [--deadline-s 540] [--json PATH] [--markdown PATH]
                                   [-- more train_bench.py options]

Each try is one ``train_bench.py --preset 7b --layers L --methods SYSTEM`` row in a process of its
own (``bench/row_process.py``): ``--warmup`` + ``--steps`` steps (default 2 + 1: the first compiles,
the last is timed), under ``--timeout`` seconds. A try "trains" when the row comes back ``ok``;
otherwise the row's status says why:

* ``OOM``: the device ran out of memory (caught in the row's process);
* ``killed``: the process died of SIGKILL, the host's out-of-memory killer (host memory: FSDP2's
  CPU offload pins the whole fp32 training state, ~16 bytes per parameter);
* ``timeout``: no result within ``--timeout`` (too slow to call trained here: raise the limit);
* ``error`` / ``n/a``: anything else, with the error.

``--search linear`` (default) tries the ``--layers`` counts in increasing order and stops at the
first failure; ``binary`` assumes that what fails at L fails above L too and bisects the list
(fewer tries for a long list). ``--deadline-s`` ends the whole run within that many seconds
(each try's limit is cut to what is left; what was not tried, or was cut short, is reported as not
tried), so a run fits one call of a time-limited machine; the JSON (``--json``) is rewritten after every try, so a run cut short keeps what it found.

Systems are train_bench.py's ``--methods`` keys: ``z3-offload-budget`` (deepcompile ZeRO-3,
optimizer state offloaded as the budget requires), ``z3-offload``, ``z3-offload-all``,
``fsdp2-offload`` (FSDP2 + CPU offload), ``fsdp2`` and ``z3`` (no offload).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import row_process  # noqa: E402
import train_bench as tb  # noqa: E402

GIB = 1024**3
REASONS = {"OOM": "device out of memory", "killed": "host out of memory (killed)", "timeout": "timeout",
           "error": "error", "n/a": "unavailable"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="z3-offload-budget,fsdp2-offload,fsdp2,z3",
                   help="comma list of train_bench.py --methods keys")
    p.add_argument("--layers", default="32,40,48,56,64", help="comma list of layer counts to try")
    p.add_argument("--search", choices=["linear", "binary"], default="linear")
    p.add_argument("--timeout", type=float, default=300, help="seconds per try")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="the whole run ends within this many seconds: each try's limit is cut to what is left, "
                        "no try starts with less than --min-try-s left, and a try cut short by the deadline "
                        "counts as not tried (not as failed)")
    p.add_argument("--min-try-s", type=float, default=90)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--nproc", type=int, default=1, help="ranks per try")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH", help="append the result table to PATH")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train_bench.py options")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in tb.METHODS]
    if unknown or not args.systems:
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(tb.METHODS)}")
    try:
        args.layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    except ValueError:
        p.error(f"--layers must be a comma list of integers, got {args.layers!r}")
    if not args.layers or args.layers[0] < 1:
        p.error("--layers needs at least one count >= 1")
    args.extra = [a for a in args.extra if a != "--"]
    return args


def next_try(layers: List[int], results: Dict[int, bool], search: str) -> Optional[int]:
    """The next layer count to try, given what trained (True) or failed (False) so far; None when
    the answer is known (the largest count that trains, and the smallest that fails, are adjacent
    in ``layers`` or at its ends)."""
    ok = [n for n in layers if results.get(n) is True]
    failed = [n for n in layers if results.get(n) is False]
    low = max(ok) if ok else None  # trains: everything below is assumed to as well
    high = min(failed) if failed else None  # fails: everything above is assumed to as well
    open_ = [n for n in layers if (low is None or n > low) and (high is None or n < high)]
    if not open_:
        return None
    return open_[0] if search == "linear" else open_[len(open_) // 2]


def try_command(args: argparse.Namespace, system: str, layers: int) -> List[str]:
    """train_bench.py options of one try (row_process adds the row's own)."""
    return ["--preset", "7b", "--layers", str(layers), "--warmup", str(args.warmup), "--steps", str(args.steps),
            *args.extra]


def params_of(layers: int, extra: List[str]) -> int:
    return tb.count_params(tb.parse_args(["--preset", "7b", "--layers", str(layers), *extra]))


def summarise(system: str, layers: List[int], tries: List[dict]) -> dict:
    ok = [t for t in tries if t["status"] == "ok"]
    failed = [t for t in tries if t["status"] != "ok"]
    best = max(ok, key=lambda t: t["layers"]) if ok else None
    first_fail = min(failed, key=lambda t: t["layers"]) if failed else None
    return {"system": system, "name": tb.METHODS[system].name, "largest": best, "first_failure": first_fail,
            "tried": [t["layers"] for t in tries], "untried": [n for n in layers if n not in {t["layers"] for t in tries}]}


def count(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"


def markdown(summaries: List[dict], header: Dict[str, str]) -> str:
    lines = [f"## {header['date (UTC)']} UTC, largest model that trains, {header['device']}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in header.items() if k != "date (UTC)"]
    lines += ["", "| system | largest that trains | step time there (ms) | device peak (GiB) | host peak (GiB) | "
                  "first that fails | why | tried |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for s in summaries:
        best, fail = s["largest"], s["first_failure"]
        cell = lambda t, key, fmt: format(t[key], fmt) if t and t.get(key) is not None else "n/a"
        lines.append("| " + " | ".join([
            s["name"],
            f"{best['layers']} layers ({count(best['params'])})" if best else "none tried trains",
            cell(best, "step_ms", ".0f"), cell(best, "peak_gib", ".1f"), cell(best, "host_peak_gib", ".1f"),
            f"{fail['layers']} layers ({count(fail['params'])})" if fail else "none tried fails",
            (REASONS.get(fail["status"], fail["status"]) + (f": {fail['note'][:160]}" if fail["note"] else "")
             ).replace("|", "\\|") if fail else "",
            ", ".join(map(str, s["tried"])) + (f"; not tried (deadline): {', '.join(map(str, s['untried']))}"
                                               if s.get("stopped_by_deadline") and s["untried"] else ""),
        ]) + " |")
    return "\n".join(lines) + "\n"


def gpu_names() -> str:
    """The GPUs, from nvidia-smi (this process never initialises CUDA: the tries need the whole
    card); a try that trains replaces it with its own description."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    names = [n.strip() for n in out if n.strip()]
    return f"{len(names)} x {names[0]}" if names else "unknown"


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    row_process.stop_children_on_termination()
    header: Dict[str, str] = {"date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                              "device": gpu_names()}
    summaries: List[dict] = []

    def write() -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"header": header, "systems": summaries}, f, indent=1)

    for system in args.systems:
        results: Dict[int, bool] = {}
        tries: List[dict] = []
        summaries.append(summarise(system, args.layers, tries))
        stopped = False
        while (layers := next_try(args.layers, results, args.search)) is not None:
            limit = args.timeout
            if args.deadline_s is not None:
                limit = min(limit, args.deadline_s - (time.monotonic() - start))
                if limit < args.min_try_s:
                    stopped = True
                    break
            print(f"== {tb.METHODS[system].name}, {layers} layers", flush=True)
            t0 = time.monotonic()
            row, env = row_process.run_row(try_command(args, system, layers), system, args.nproc, limit)
            if row.status == "timeout" and limit < args.timeout:  # cut by the deadline: unknown, not failed
                print(f"  -> not finished before the deadline ({limit:.0f} s)", flush=True)
                stopped = True
                break
            if env:
                header.update({k: env[k] for k in ("device", "torch", "deepcompile commit", "source digest") if k in env})
            tries.append({"layers": layers, "params": params_of(layers, args.extra), "status": row.status,
                          "note": row.note, "step_ms": row.step_ms, "peak_gib": row.peak_gib,
                          "host_peak_gib": row.host_peak_gib, "seconds": time.monotonic() - t0})
            results[layers] = row.status == "ok"
            print(f"  -> {row.status}" + (f": {row.note}" if row.note and row.status != "ok" else "")
                  + f" ({tries[-1]['seconds']:.0f} s)", flush=True)
            summaries[-1] = summarise(system, args.layers, tries)
            write()
        summaries[-1] = dict(summarise(system, args.layers, tries), stopped_by_deadline=stopped)
        write()
    header["command"] = "python3 " + " ".join(sys.argv)
    header["tries"] = (f"{args.warmup} warm-up + {args.steps} measured steps, {args.timeout:.0f} s limit each, "
                       f"{args.nproc} rank(s); layers {','.join(map(str, args.layers))}, {args.search} search")
    write()
    text = markdown(summaries, header)
    print("\n" + text, flush=True)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
