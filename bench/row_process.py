"""One ``train_bench.py`` row per process (``--isolate``), and why a row's process gave no row.

A 7B model's rows each hold most of the machine: FSDP2 with CPU offload pins about 108 GB of host
memory, deepcompile most of the device. Run in one process, a row would inherit what the previous
row's allocator caches and pinned pools still hold, and a row that exhausts host memory would take
the whole table down with it. Here each row is a ``torchrun --standalone`` child of its own, which
writes its row as JSON (``--child-json``); the parent (a plain ``python3`` process that touches no
GPU) collects the rows, and a child that dies or times out becomes a row saying so:

* ``timeout``: no result within ``--row-timeout`` seconds; the child's process group is stopped.
* ``killed``: a worker died of SIGKILL, which on these machines is the kernel's out-of-memory
  killer (host memory); the note says so and quotes the last line of the output.
* ``error``: any other exit without a row; the note is the last error line of the output.

A row the child did produce keeps the child's status (``OOM`` is the device's out-of-memory,
caught inside the child).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
# What a surrounding torchrun sets; a child torchrun --standalone must not inherit it.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


_running: List[subprocess.Popen] = []  # the child being waited for (stopped if this process is told to stop)


def stop_children_on_termination() -> None:
    """On SIGTERM (e.g. ``timeout`` around the whole run) stop the running child's process group
    before exiting: it runs in a session of its own, so it would otherwise outlive this process and
    keep the device and host memory the next command needs."""

    def handler(signum, frame):
        for proc in list(_running):
            stop_group(proc, grace=10)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def run_streaming(cmd: Sequence[str], timeout: Optional[float], keep: int = 80,
                  env: Optional[Dict[str, str]] = None) -> Tuple[Optional[int], List[str]]:
    """Run ``cmd`` in a session of its own, echoing its output (stdout and stderr) as it comes;
    returns (exit code, or None after a timeout, and the last ``keep`` lines)."""
    tail: collections.deque = collections.deque(maxlen=keep)
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True, env=env, errors="replace")

    def pump() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    _running.append(proc)
    try:
        code: Optional[int] = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
        stop_group(proc)
    finally:
        _running.remove(proc)
    reader.join(timeout=30)
    return code, list(tail)


def stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """Stop the child's whole process group (torchrun and its workers): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)  # the group this child leads (start_new_session)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def failure(code: Optional[int], tail: List[str], timeout: Optional[float]) -> Tuple[str, str]:
    """(status, note) of a row process that wrote no row."""
    if code is None:
        return "timeout", f"no result within {timeout:.0f} s"
    text = "\n".join(tail)
    # The worker's own error, not torchrun's report that a worker failed.
    ours = [line for line in tail if not any(s in line for s in ("torch.distributed.elastic", "ChildFailedError",
                                                                 "error_file", "traceback :"))
            and line.strip().strip("=-")]  # torchrun's ==== / ---- rules say nothing
    last = next((line.strip() for line in reversed(ours)
                 if "Error" in line or "error:" in line or "Exception" in line), ours[-1].strip() if ours else "")
    if code in (-9, 137) or "SIGKILL" in text or "exitcode  : -9" in text:
        return "killed", "killed by SIGKILL (host out of memory?)" + (f"; {last[:200]}" if last else "")
    return "error", f"exit {code}" + (f": {last[:240]}" if last else "")


def child_command(argv: Sequence[str], key: str, nproc: int, out: str) -> List[str]:
    """``torchrun --standalone`` of train_bench.py with the parent's options, for one row (options
    given later win in argparse, so the overrides go last)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            os.path.join(HERE, "train_bench.py"), *argv,
            "--methods", key, "--no-isolate", "--no-pcie", "--child-json", out]


def run_row(argv: Sequence[str], key: str, nproc: int, timeout: Optional[float], name: Optional[str] = None):
    """One row in its own process: (train_report.Row, the child's header or None). ``name``: the
    row's label should the process give no row (default: the method's)."""
    from train_report import Row  # here: long_sequence_bench and trainer_bench use this module without torch
    from train_rows import METHODS

    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    with tempfile.TemporaryDirectory(prefix="train_bench_row_") as tmp:
        out = os.path.join(tmp, "row.json")
        code, tail = run_streaming(child_command(argv, key, nproc, out), timeout, env=env)
        if code is not None and os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                data = json.load(f)
            return Row(**data["rows"][0]), data["env"]
    status, note = failure(code, tail, timeout)
    return Row(name or METHODS[key].name, status=status, note=note), None


def measure_pcie(args) -> Optional[Dict[str, float]]:
    """pcie_bench.py in a process of its own (the parent holds no CUDA context)."""
    import torch

    if not args.pcie or not torch.cuda.is_available():
        return None
    with tempfile.TemporaryDirectory(prefix="pcie_") as tmp:
        out = os.path.join(tmp, "pcie.json")
        code, tail = run_streaming([sys.executable, os.path.join(HERE, "pcie_bench.py"), "--gib", str(args.pcie_gib),
                                    "--repeats", str(args.pcie_repeats), "--json", out], timeout=300)
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
    return {"error": failure(code, tail, 300)[1]}


def run_isolated(args, argv: List[str]) -> int:
    """train_bench's main for ``--isolate``: PCIe first, then each row in its own process, one table."""
    import shlex

    from train_report import describe_pcie, finish, write_json
    from train_rows import method_of

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("--isolate starts its own torchrun per row (--nproc ranks): run it with python3, "
                         "not under torchrun")
    stop_children_on_termination()
    pcie = measure_pcie(args)
    rows, child_env = [], None

    def header() -> Dict[str, str]:
        env = dict(child_env or {"date (UTC)": "unknown", "device": "unknown (no row process reported)"})
        env["command"] = "python3 " + shlex.join(sys.argv)
        env["isolation"] = (f"one torchrun process per row, {args.nproc} rank(s)"
                            + (f", {args.row_timeout:.0f} s each at most" if args.row_timeout else ""))
        if pcie is not None:
            env["PCIe"] = describe_pcie(pcie)
        return env

    for key in args.methods:
        method = method_of(key, args)  # a deepcompile row's layout is in its label (bench/layouts.py)
        print(f"== {method.name} (own process)", flush=True)
        row, env = run_row(argv, key, args.nproc, args.row_timeout, name=method.name)
        row.layout = row.layout or method.layout
        child_env = child_env or env
        rows.append(row)
        print(f"  -> {row.status}" + (f": {row.note}" if row.note else ""), flush=True)
        if args.json:  # after every row: a run stopped from outside keeps the rows it has
            write_json(args.json, header(), rows, pcie)
    env = header()
    print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)
    finish(args, env, rows, pcie)
    return 0
