"""The results of bench/long_sequence_bench.py: one summary per system and the Markdown tables.

Kept apart from the driver and the worker so that reading or merging results needs neither torch
nor the systems under test.
"""

from __future__ import annotations

from typing import Dict, List

SYSTEMS = {
    "dc": "deepcompile ZeRO-3 + Ulysses SP",
    "ds-alst": "DeepSpeed ZeRO-3 + Ulysses (ALST route)",
    "ds-alst-dc": "DeepSpeed DeepCompile ZeRO-3 + Ulysses (ALST route)",
}
STATUS_WHY = {"OOM": "device out of memory", "killed": "host out of memory (killed)", "timeout": "timeout",
              "error": "error", "n/a": "unavailable", "refused": "refused"}


def not_run(system: str, seq: int, status: str, note: str) -> Dict[str, object]:
    return {"system": system, "seq": seq, "status": status, "note": note}


def summarise(system: str, rows: List[dict]) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] not in ("ok", "refused", "n/a")]  # n/a: not run here
    unavailable = next((r["note"] for r in rows if r["status"] == "n/a"), None)
    return {"system": system, "name": SYSTEMS[system], "longest": max(ok, key=lambda r: r["seq"]) if ok else None,
            "first_failure": min(failed, key=lambda r: r["seq"]) if failed else None, "unavailable": unavailable,
            "rows": rows}


def fmt(value, spec: str) -> str:
    return format(value, spec) if value is not None else "n/a"


def markdown(summaries: List[dict], seqs: List[int], header: Dict[str, str]) -> str:
    esc = lambda s: str(s).replace("|", "\\|")
    lines = [f"## {header['date (UTC)']} UTC, longest sequence that trains (Ulysses SP), {header['device']}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in header.items() if k != "date (UTC)"]
    lines += ["", "| system | longest that trains | first that fails | "
              + " | ".join(f"tokens/s at {s:,}" for s in seqs) + " |",
              "| --- | ---: | --- | " + " | ".join("---:" for _ in seqs) + " |"]
    for s in summaries:
        by_seq = {r["seq"]: r for r in s["rows"]}
        best, fail = s["longest"], s["first_failure"]
        cells = [s["name"], f"{best['seq']:,}" if best else esc(f"n/a: {s['unavailable']}") if s.get("unavailable")
                 else "none tried trains",
                 esc(f"{fail['seq']:,}: {STATUS_WHY.get(fail['status'], fail['status'])}"
                     + (f" ({fail['note'][:120]})" if fail.get("note") else "")) if fail
                 else "n/a" if s.get("unavailable") and not best else "none tried fails"]
        for seq in seqs:
            r = by_seq.get(seq)
            cells.append("not tried" if r is None else f"{r['tokens_per_s']:,.0f}" if r["status"] == "ok"
                         else r["status"])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| system | seq | status | ms/step | tokens/s | peak GiB | first step (s) | note |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for s in summaries:
        for r in s["rows"]:
            lines.append("| " + " | ".join([s["name"], f"{r['seq']:,}", r["status"], fmt(r.get("step_ms"), ".0f"),
                                            fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("peak_gib"), ".1f"),
                                            fmt(r.get("first_step_s"), ".1f"), esc(r.get("note") or "")[:200]])
                         + " |")
    return "\n".join(lines) + "\n"
