"""The table of ``bench/train_bench.py`` and where it goes: the ``Row`` (the JSON rows' format), the
ratios to the peers, the text and Markdown tables, the header, ``--markdown``, ``--json`` and
``--merge``. The columns: train_bench.py's docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
from typing import Dict, List, Optional

import torch

import layouts
import peer_rows
from train_core import REPO_ROOT, Context, flops_per_token
from train_rows import FSDP2_NAME, FSDP2_OFFLOAD_NAME


@dataclasses.dataclass
class Row:
    """One table row. ``status`` is "ok", "n/a", "OOM" or "error"; numbers are set only when ok."""

    method: str
    status: str = "ok"
    note: str = ""
    step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None
    peak_gib: Optional[float] = None
    compile_s: Optional[float] = None
    scheduled_s: Optional[float] = None  # time to the end of the first scheduled step
    vs_fsdp2: Optional[float] = None  # scheduled_s / FSDP2 + compile's first step, same run
    warm_scheduled_s: Optional[float] = None  # --warm-start: the same, restarted on warm caches
    loss: Optional[float] = None
    losses: Optional[List[float]] = None  # every step's loss, warm-up included (JSON only)
    # --trace: rank 0's step_trace.transfer_summary (per step: h2d_ms, h2d_hidden_ms, h2d_gb, the
    # same for d2h, transfer_ms, hidden_ms, step_ms)
    transfers: Optional[Dict[str, float]] = None
    vs_fsdp2_offload: Optional[float] = None  # tokens/s over FSDP2 + CPU offload's, same run
    host_peak_gib: Optional[float] = None  # --isolate: the row process's peak resident memory
    repeat: Optional[int] = None  # --peer-repeats: which run of a repeated row (shown after its name)
    layout: Optional[str] = None  # a deepcompile row's layout (bench/layouts.py; also in its label)
    # rank 0's bytes per link of the last measured step (engine.step_report.comm_bytes): per link
    # ("shard", "replica", "secondary") ranks, payload bytes per collective kind, and wire bytes
    comm_bytes: Optional[Dict[str, Dict[str, int]]] = None


def compare_with_fsdp2(rows: List[Row]) -> None:
    """Fill ``vs_fsdp2``: each row's time to its first scheduled step over FSDP2 + compile's
    first step in this run (left empty without an FSDP2 row)."""
    fsdp2 = next((r for r in rows if r.method == FSDP2_NAME and r.status == "ok"), None)
    if fsdp2 is None or not fsdp2.compile_s:
        return
    for r in rows:
        if r.status == "ok" and r.scheduled_s is not None:
            r.vs_fsdp2 = r.scheduled_s / fsdp2.compile_s


def compare_with_fsdp2_offload(rows: List[Row]) -> None:
    """Fill ``vs_fsdp2_offload``: each row's tokens/s over FSDP2 + CPU offload's in this run
    (issue 18's target: at least 5x)."""
    peer = next((r for r in rows if r.method == FSDP2_OFFLOAD_NAME and r.status == "ok"), None)
    if peer is None or not peer.tokens_per_s:
        return
    for r in rows:
        if r.status == "ok" and r.tokens_per_s:
            r.vs_fsdp2_offload = r.tokens_per_s / peer.tokens_per_s


def pcie_floor_ms(transfers: Optional[Dict[str, float]], pcie: Optional[Dict[str, float]]) -> Optional[float]:
    """The step time if host-device copies were all that ran: each direction's bytes per step over
    that direction's bandwidth when both run at once (the directions overlap each other), the
    larger of the two. None without a trace or a bandwidth."""
    if not transfers or not pcie or "error" in pcie:
        return None
    h2d = transfers["h2d_gb"] / pcie["both_h2d_gb_s"] if transfers["h2d_gb"] else 0.0
    d2h = transfers["d2h_gb"] / pcie["both_d2h_gb_s"] if transfers["d2h_gb"] else 0.0
    return 1e3 * max(h2d, d2h)


# ------------------------------------------------------------------------------------- output

COLUMNS = ["method", "step time (ms)", "tokens/s/GPU", "TFLOP/s/GPU", "peak mem (GiB)", "first step (s)",
           "first scheduled step (s)", "÷ FSDP2 first step", "warm: first scheduled step (s)", "loss", "note"]
# Shown only when some row has them (offload runs): before "loss".
OFFLOAD_COLUMNS = ["× FSDP2 offload tokens/s", "transfer / hidden ms (%)", "GB moved/step", "PCIe floor (ms)",
                   "traced step (ms)", "host peak (GiB)"]


def _num(row: Row, value: Optional[float], fmt: str) -> str:
    if row.status != "ok":
        return row.status  # "n/a", "OOM", "error", "timeout" or "killed" in every number column
    if value is None:
        return "n/a"
    # Tiny smoke-run models would print 0.0; keep three significant digits there.
    return format(value, fmt) if abs(value) >= 1 or value == 0 else format(value, ".3g")


def transfer_cell(transfers: Optional[Dict[str, float]]) -> str:
    """ "transfer / hidden ms (%)": H2D + D2H copy time per step and the part hidden behind kernels."""
    if not transfers:
        return "n/a"
    busy, hidden = transfers["transfer_ms"], transfers["hidden_ms"]
    pct = f"{100 * hidden / busy:.0f} %" if busy else "-"
    return f"{busy:.1f} / {hidden:.1f} ({pct})"


def show_offload_columns(rows: List[Row]) -> bool:
    return any(r.transfers or r.vs_fsdp2_offload is not None or r.host_peak_gib is not None for r in rows)


def show_comm_column(rows: List[Row]) -> bool:
    return any(r.comm_bytes for r in rows)


def columns(rows: List[Row]) -> List[str]:
    """The table's head: the comm column where some row counted its bytes per link (deepcompile
    rows), the offload columns where some row has offload data, both before "loss"."""
    extra = ([layouts.COMM_COLUMN] if show_comm_column(rows) else []) + \
        (OFFLOAD_COLUMNS if show_offload_columns(rows) else [])
    return COLUMNS[:-2] + extra + COLUMNS[-2:]


def cells(row: Row, offload_columns: bool = False, pcie: Optional[Dict[str, float]] = None,
          comm_column: bool = False) -> List[str]:
    num = lambda value, fmt: _num(row, value, fmt)
    label = row.method + (f" (run {row.repeat})" if row.repeat else "")
    out = [label, num(row.step_ms, ".1f"), num(row.tokens_per_s, ",.0f"), num(row.tflops, ".1f"),
           num(row.peak_gib, ".2f"), num(row.compile_s, ".1f"), num(row.scheduled_s, ".1f"),
           num(row.vs_fsdp2, ".2f"), num(row.warm_scheduled_s, ".1f")]
    if comm_column:
        out.append(layouts.comm_cell(row.comm_bytes) if row.status == "ok" else row.status)
    if offload_columns:
        t = row.transfers
        out += [num(row.vs_fsdp2_offload, ".2f"),
                transfer_cell(t) if row.status == "ok" else row.status,
                num(t["h2d_gb"] + t["d2h_gb"] if t else None, ".2f"),
                num(pcie_floor_ms(t, pcie), ".1f"),
                num(t["step_ms"] if t else None, ".1f"),
                format(row.host_peak_gib, ".1f") if row.host_peak_gib is not None else "n/a"]
    return out + [num(row.loss, ".4f"), row.note]


def text_table(rows: List[Row], pcie: Optional[Dict[str, float]] = None) -> str:
    head = columns(rows)
    wide, comm = show_offload_columns(rows), show_comm_column(rows)
    body = [head] + [cells(r, wide, pcie, comm) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(head))]
    fmt = lambda line: "  ".join(c.ljust(w) if i in (0, len(line) - 1) else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(line, widths))).rstrip()
    rule = "-" * len(fmt(head))
    return "\n".join([fmt(head), rule] + [fmt(line) for line in body[1:]])


def markdown_table(rows: List[Row], pcie: Optional[Dict[str, float]] = None) -> str:
    head = columns(rows)
    wide, comm = show_offload_columns(rows), show_comm_column(rows)
    esc = lambda s: s.replace("|", "\\|")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + " |"]
    lines += ["| " + " | ".join(esc(c) for c in cells(r, wide, pcie, comm)) + " |" for r in rows]
    return "\n".join(lines)


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + (" (modified)" if dirty else "")) if rev else "unknown"
    except Exception:
        return "unknown"


def source_digest() -> str:
    """scripts/source_digest.sh: names the tree that ran even where the git metadata is stale."""
    try:
        out = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "source_digest.sh")], capture_output=True,
                             text=True, timeout=30).stdout.strip()
        return out or "unknown"
    except Exception:
        return "unknown"


def environment(ctx: Context, pcie: Optional[Dict[str, float]] = None) -> Dict[str, str]:
    a = ctx.args
    if ctx.is_cuda:
        device = torch.cuda.get_device_name(ctx.device)
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    else:
        device, nccl = "CPU", "n/a (gloo)"
    return {
        "command": "torchrun --nproc-per-node {} {}".format(ctx.world, shlex.join(sys.argv)),
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": f"{ctx.world} x {device}",
        "world size": str(ctx.world),
        "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if ctx.is_cuda else ""),
        "NCCL": nccl,
        "deepcompile commit": git_revision(),
        "source digest": source_digest(),
        "model": (f"Llama hidden {a.hidden}, layers {a.layers}, heads {a.heads} (kv {a.kv_heads}), "
                  f"intermediate {a.intermediate}, vocab {a.vocab}; {ctx.n_params / 1e6:,.1f} M parameters"),
        "batch": f"micro-batch {a.micro_batch} x seq {a.seq} per rank",
        "steps": f"{a.warmup} warm-up (first compiles) + {a.steps} measured; backend {ctx.backend}",
        "compile caches": {
            "cold": "cold (each row starts on an empty cache directory, in-memory caches cleared)",
            "shared": "shared (a row may reuse earlier compiles of this machine)",
            "off": "off (caches disabled)",
        }[a.compile_cache] + ("; warm restart per row" if a.warm_start else ""),
        "deepcompile": (f"reduce_bucket_size {a.reduce_bucket_size:,}, "
                        f"stage3_param_persistence_threshold {a.persistence_threshold:,}"
                        + (f", communication_data_type {a.communication_data_type}"
                           if a.communication_data_type else "")
                        + (f", sub_group_size {a.sub_group_size:.0e}" if a.sub_group_size else "")
                        + (", optimizer_step_in_backward" if a.optimizer_step_in_backward else "")),
        "FLOPs/token": f"{flops_per_token(a, ctx.n_params) / 1e9:.3f} G (6 N + 12 L H S)",
        "init": {"device": "built on the device in the training dtype",
                 "meta": "built on meta; deepcompile.initialize(init_fn=, device=) / FSDP2 to_empty + init"}[a.init],
        "PCIe": describe_pcie(pcie) if ctx.is_cuda else "n/a (CPU)",
    }


def describe_pcie(pcie: Optional[Dict[str, float]]) -> str:
    from pcie_bench import describe

    return describe(pcie)


def host_peak_bytes() -> Optional[int]:
    """This process's peak resident memory (VmHWM; pinned host buffers count once touched)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def append_markdown(path: str, env: Dict[str, str], rows: List[Row], pcie: Optional[Dict[str, float]] = None) -> None:
    lines = [f"## {env['date (UTC)']} UTC, {env['device']}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()]
    lines += ["", markdown_table(rows, pcie), ""]
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write("# Benchmark results (bench/train_bench.py)\n\n")
        f.write("\n".join(lines) + "\n")



def write_json(path: str, env: Dict[str, str], rows: List[Row], pcie: Optional[Dict[str, float]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"env": env, "pcie": pcie, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


def finish(args: argparse.Namespace, env: Dict[str, str], rows: List[Row], pcie: Optional[Dict[str, float]]) -> None:
    """The ratios, the table and its files (rank 0 / the parent of --isolate)."""
    peer_rows.number_repeats(rows)
    compare_with_fsdp2(rows)
    compare_with_fsdp2_offload(rows)
    print("\n" + text_table(rows, pcie), flush=True)
    if args.markdown:
        append_markdown(args.markdown, env, rows, pcie)
        print(f"\nappended to {args.markdown}", flush=True)
    if args.json:
        write_json(args.json, env, rows, pcie)
        print(f"wrote {args.json}", flush=True)


def merge(args: argparse.Namespace) -> int:
    """--merge: one table of the rows of several --json files; the header is the first file's, the
    PCIe figure the first one measured (each file's own is listed)."""
    env: Dict[str, str] = {}
    rows: List[Row] = []
    pcie = None
    for i, path in enumerate(args.merge):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        env = env or dict(data["env"])
        env[f"part {i + 1}"] = f"{path}: {data['env'].get('command', '?')} ({data['env'].get('date (UTC)', '?')} UTC)"
        if data.get("pcie") and "error" not in data["pcie"]:
            pcie = pcie or data["pcie"]
            env[f"part {i + 1} PCIe"] = describe_pcie(data["pcie"])
        fields = {f.name for f in dataclasses.fields(Row)}
        for r in data["rows"]:
            r = {k: v for k, v in r.items() if k in fields}
            r.update(vs_fsdp2=None, vs_fsdp2_offload=None)  # recomputed across all parts
            rows.append(Row(**r))
    env["command"] = "python3 " + shlex.join(sys.argv)
    print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)
    finish(args, env, rows, pcie)
    return 0
