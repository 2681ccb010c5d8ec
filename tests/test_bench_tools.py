"""The offline analysis helpers of bench/: interval arithmetic of the step trace and the
allocator-history replay of memory_peak.py (their numbers go into bench/RESULTS.md)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import memory_peak  # noqa: E402
import step_trace  # noqa: E402


def _value(lines, prefix):
    line = next(line for line in lines if line.startswith(prefix))
    return float(line.split(":")[1].split()[0])


def test_overlap_splits_exposed_communication_from_hidden():
    # compute [0, 10) and [30, 40) us; NCCL [5, 20): 5 us hidden under compute, 10 us exposed;
    # nothing runs in [20, 30) and [40, 50).
    kernels = [("gemm", 0.0, 10.0), ("ncclAllGather", 5.0, 20.0), ("gemm", 30.0, 40.0), ("add", 32.0, 35.0)]
    lines = step_trace.overlap_lines([(n, s * 1000, e * 1000) for n, s, e in kernels], wall_ms=50.0, steps=1)
    assert _value(lines, "compute kernels busy") == pytest.approx(20.0)
    assert _value(lines, "nccl kernels busy") == pytest.approx(15.0)
    assert _value(lines, "nccl with no compute running") == pytest.approx(10.0)
    assert _value(lines, "no kernel running at all") == pytest.approx(20.0)


def test_generated_kernels_are_counted_per_step():
    kernels = [("triton_per_fused_add_mean_0", 0.0, 2000.0), ("sm90_gemm", 2000.0, 9000.0),
               ("triton_poi_fused_mul_1", 9000.0, 10000.0), ("ncclAllGather", 0.0, 5000.0)]
    line = step_trace.generated_kernel_line(kernels, steps=2)
    assert line == "inductor-generated kernels: 1 launches/step, 1.5 ms/step"


def test_memory_peak_replays_allocations_and_counts_the_baseline():
    frames_kernel = [{"filename": "/site/torch/_ops.py", "line": 1, "name": "__call__"},
                     {"filename": "/tmp/torchinductor/ab.py", "line": 9, "name": "call"}]
    snapshot = {
        # At the dump: 100 bytes from before the trace and the 50-byte allocation still alive.
        "segments": [{"device": 0, "blocks": [{"size": 100, "state": "active_allocated"},
                                              {"size": 50, "state": "active_allocated"},
                                              {"size": 70, "state": "inactive"}]}],
        "device_traces": [[
            {"action": "alloc", "addr": 1, "size": 30, "frames": frames_kernel},
            {"action": "alloc", "addr": 2, "size": 50, "frames": []},
            {"action": "free_requested", "addr": 1, "size": 30},
            {"action": "free_completed", "addr": 1, "size": 30},
            {"action": "free_completed", "addr": 9, "size": 20},  # allocated before the trace
        ]],
    }
    baseline, top, live = memory_peak.peak(snapshot)
    assert baseline == 120  # 150 alive at the end, 30 of them net from the trace
    assert top == 200
    assert sorted(live) == [1, 2]
    assert memory_peak.where(frames_kernel) == "ab.py:9 call"
    assert memory_peak.where([]) == "(no stack)"


def test_memory_timeline_reports_the_highest_level_per_slice():
    frames = [{"filename": "/tmp/torchinductor/cd.py", "line": 3, "name": "call"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 30, "frames": frames},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 30},
        {"action": "free_completed", "addr": 2, "size": 50},
    ]
    rows = memory_peak.timeline({"device_traces": [events]}, device=0, slices=2)
    assert rows == [(0, 80, "(no stack)"), (2, 80, "(the level the slice started at)")]


def test_time_to_the_first_scheduled_step_and_the_ratio_to_fsdp2():
    import train_bench

    # Profiled step 0, profiled step 1 after the re-plan, compiled step 2: the sum of all three.
    assert train_bench.time_to_schedule([5.0, 1.0, 3.0, 0.1], [False, False, True, True]) == pytest.approx(9.0)
    assert train_bench.time_to_schedule([5.0, 1.0], [False, False]) is None
    Row = train_bench.Row
    rows = [Row(train_bench.METHODS["z3-prefetch"].name, compile_s=2.0, scheduled_s=9.0),
            Row(train_bench.METHODS["fsdp2"].name, compile_s=6.0, scheduled_s=6.0),
            Row(train_bench.METHODS["z3"].name, status="OOM")]
    train_bench.compare_with_fsdp2(rows)
    assert rows[0].vs_fsdp2 == pytest.approx(1.5) and rows[1].vs_fsdp2 == pytest.approx(1.0)
    assert rows[2].vs_fsdp2 is None
    table = train_bench.markdown_table(rows).splitlines()
    assert len({line.count(" | ") for line in table}) == 1, "a row has another number of cells than the header"
    without = [Row(train_bench.METHODS["z3"].name, compile_s=2.0, scheduled_s=2.0)]
    train_bench.compare_with_fsdp2(without)  # no FSDP2 row in the run: no ratio
    assert without[0].vs_fsdp2 is None

def test_checkpointing_memory_runs_on_cpu_and_checkpointing_saves_only_layer_inputs(tmp_path):
    """bench/checkpointing_memory.py end to end (one rank, gloo, the tiny preset, ZeRO-3), as the
    GPU run uses it. Checkpointed, the compiled forward may keep for the backward only the layers'
    inputs (hidden states, rotary cos/sin) and what the model saves outside its layers (the eager measure of the same batch); the
    plain one keeps the layer interiors too. Both runs train the same model on the same data, so
    their losses agree (bf16 model: 1e-2 relative covers the rounding of a recomputed forward); a
    smoke check only: tests/test_activation_checkpointing.py makes the parity claim."""
    import json
    import subprocess

    out = tmp_path / "ckpt.json"
    md = tmp_path / "ckpt.md"
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "checkpointing_memory.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", script,
           "--preset", "tiny", "--stages", "3", "--steps", "1", "--json", str(out), "--markdown", str(md)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    eager = result["eager"]
    assert all(s > i > 0 for s, i in zip(eager["saved_per_layer"], eager["input_per_layer"]))
    runs = {r["checkpointing"]: r for r in result["runs"]}
    assert set(runs) == {None, "non-reentrant"} and all(r["status"] == "ok" for r in runs.values())
    plain, ckpt = runs[None]["saved_bytes"], runs["non-reentrant"]["saved_bytes"]
    kept = sum(eager["input_per_layer"]) + eager["shared_inputs"] + eager["outside_layers"]
    assert ckpt <= kept < plain
    assert runs["non-reentrant"]["loss"] == pytest.approx(runs[None]["loss"], rel=1e-2)
    text = md.read_text()
    assert "| ZeRO-3, checkpointed (non-reentrant) |" in text and "torch: " in text
