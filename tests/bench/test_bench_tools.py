"""The offline analysis helpers of bench/: interval arithmetic of the step trace (communication
and, for offload, host-device copies against compute), the allocator-history replay of
memory_peak.py, the table and its columns; and, end to end on CPU, train_bench's offload rows in
processes of their own, largest_model.py's search, and checkpointing_memory.py (their GPU numbers
go into bench/RESULTS.md)."""

from __future__ import annotations

import os
import sys

import pytest

from _harness.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

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

@pytest.mark.world_size(1)  # torchrun --nproc-per-node 1
def test_checkpointing_memory_runs_on_cpu_and_checkpointing_saves_only_layer_inputs(tmp_path):
    """bench/checkpointing_memory.py end to end (one rank, gloo, the tiny preset, ZeRO-3), as the
    GPU run uses it. Checkpointed, the compiled forward may keep for the backward only the layers'
    inputs (hidden states, rotary cos/sin) and what the model saves outside its layers (the eager measure of the same batch); the
    plain one keeps the layer interiors too. Both runs train the same model on the same data, so
    their losses agree (bf16 model: 1e-2 relative covers the rounding of a recomputed forward); a
    smoke check only: tests/parity/test_activation_checkpointing.py makes the parity claim."""
    import json
    import subprocess

    out = tmp_path / "ckpt.json"
    md = tmp_path / "ckpt.md"
    script = os.path.join(ROOT, "bench", "checkpointing_memory.py")
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


def test_checkpointing_summary_does_not_count_kept_layer_inputs_as_removed():
    """The verdict against the compiled runs' measure: D (saved bytes, plain - checkpointed) less
    the layers' other inputs, which the checkpointed run keeps. A reduction between the two is a
    yes for what checkpointing removes and a no for D itself."""
    import checkpointing_memory as cm
    import train_bench as tb

    gib = cm.GIB
    eager = cm.EagerActivations([3 * gib, 3 * gib], [gib // 8, gib // 8], shared_inputs=1_064_960, outside_layers=gib)
    plain = cm.Result(cm.Variant(3, None, regional=True), tb.Row("plain", peak_gib=33.0), saved_bytes=20 * gib)
    ckpt_peak = 33.0 - (16 * gib - 1_000_000) / gib  # lower by D - 1 MB: short of D, beyond D - 1.06 MB
    ckpt = cm.Result(cm.Variant(3, "non-reentrant", regional=True), tb.Row("ckpt", peak_gib=ckpt_peak),
                     saved_bytes=4 * gib)
    line = cm.summary(eager, [plain, ckpt])[-1]
    assert line.startswith("- ZeRO-3, per layer, checkpointed (non-reentrant): peak lower by")
    assert "(compiled forward's saved bytes, plain - checkpointed): no" in line
    assert "(what checkpointing removes): yes (margin +64,960 bytes)" in line


def test_checkpointed_layer_keeps_rotary_inputs_unseen_by_saved_tensors_hooks():
    """Why the summary subtracts the layers' other inputs from D: on a real LlamaForCausalLM the
    plain layers save the rotary cos/sin for their backward (saved_tensors_hooks count them),
    while under transformers' gradient checkpointing they are held by the checkpoint's recompute
    closure, which no pack hook sees, though they stay alive just the same."""
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import checkpointing_memory as cm

    from deepcompile import compat

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=64, vocab_size=64, use_cache=False)
    counted = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        if checkpointed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable()
            model.train()
        rotary = []
        model.model.layers[0].register_forward_pre_hook(
            lambda m, a, kw: rotary.extend(compat.storage_id(t) for t in kw["position_embeddings"]),
            with_kwargs=True)
        counter = cm.SavedBytes(cm.parameter_storages(model))
        tokens = torch.randint(0, 64, (2, 16))
        with counter.active():
            model(input_ids=tokens, labels=tokens).loss.backward()
        assert len(rotary) == 2
        counted[checkpointed] = [ptr in counter.seen for ptr in rotary]
    assert counted == {False: [True, True], True: [False, False]}


# ---- issue 18: transfer/compute overlap, the offload rows, one process per row ----------------------


def _chrome_trace():
    """A hand-made Chrome trace (times in us: 1 ms = 1000 us). Kernels: stream 7 [0, 10) and
    [20, 30) ms, stream 9 [25, 40) ms. H2D copies on stream 13: [5, 25) (2 GB) and [22, 28) (1 GB),
    which overlap each other in [22, 25). D2H copies: stream 7 [28, 45) (4 GB), stream 9 [35, 50)
    (2 GB). Not transfers: a device-to-device copy, a memset, a CPU op."""
    ms = 1000.0

    def x(cat, name, start, end, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": start * ms, "dur": (end - start) * ms, "args": args}

    return {"traceEvents": [
        x("kernel", "sm90_gemm", 0, 10, stream=7), x("kernel", "triton_poi_fused_0", 20, 30, stream=7),
        x("kernel", "sm90_gemm", 25, 40, stream=9),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5, 25, stream=13, bytes=2_000_000_000),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 22, 28, stream=13, bytes=1_000_000_000),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 28, 45, stream=7, bytes=4_000_000_000),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 35, 50, stream=9, bytes=2_000_000_000),
        x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 50, stream=13, bytes=8),
        x("gpu_memset", "Memset (Device)", 0, 50, stream=13),
        x("cpu_op", "aten::mm", 0, 50),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0, "args": {"stream": 7}},
    ]}


def test_transfer_overlap_counts_copy_time_once_and_hides_only_behind_other_streams():
    copies, kernels = step_trace.copies_and_kernels(_chrome_trace())
    assert len(copies) == 4 and len(kernels) == 3  # DtoD, memset, the CPU op and the instant event left out
    t = step_trace.transfer_overlap(copies, kernels)
    # H2D: busy = |[5, 28)| = 23 ms (the overlap [22, 25) once). Kernels on other streams than 13:
    # [0, 10) u [20, 40); covered: [5, 10) and [20, 28) = 5 + 8 = 13 ms.
    assert t["H2D"].busy_us == pytest.approx(23_000) and t["H2D"].hidden_us == pytest.approx(13_000)
    assert (t["H2D"].nbytes, t["H2D"].copies) == (3_000_000_000, 2)
    # D2H: busy = |[28, 50)| = 22 ms. The copy on stream 7 is covered by stream 9's kernel in
    # [28, 40) = 12 ms (stream 7's own kernel [20, 30) does not count); the copy on stream 9 by
    # stream 7's kernels not at all ([35, 50) misses [20, 30)), though stream 9's kernel runs
    # until 40: a kernel on the copy's own stream never hides it.
    assert t["D2H"].busy_us == pytest.approx(22_000) and t["D2H"].hidden_us == pytest.approx(12_000)
    assert (t["D2H"].nbytes, t["D2H"].copies) == (6_000_000_000, 2)
    # Per step over 2 traced steps of 100 ms wall in all.
    s = step_trace.transfer_summary(t, steps=2, wall_ms=100.0)
    assert s == pytest.approx({"step_ms": 50.0, "h2d_ms": 11.5, "h2d_hidden_ms": 6.5, "h2d_gb": 1.5,
                               "d2h_ms": 11.0, "d2h_hidden_ms": 6.0, "d2h_gb": 3.0,
                               "transfer_ms": 22.5, "hidden_ms": 12.5})
    import train_bench

    assert train_bench.transfer_cell(s) == "22.5 / 12.5 (56 %)"
    # Transfer-bound floor: each direction's GB over its rate with both running, the larger:
    # H2D 1.5 GB / 20 GB/s = 75 ms, D2H 3 GB / 25 GB/s = 120 ms.
    pcie = {"both_h2d_gb_s": 20.0, "both_d2h_gb_s": 25.0}
    assert train_bench.pcie_floor_ms(s, pcie) == pytest.approx(120.0)
    assert train_bench.pcie_floor_ms(s, {"error": "no CUDA device"}) is None
    assert train_bench.pcie_floor_ms(None, pcie) is None


def test_transfer_overlap_without_copies_or_kernels():
    assert step_trace.transfer_overlap([], [(7, 0.0, 10.0)]) == {}
    t = step_trace.transfer_overlap([("H2D", 1, 0.0, 10.0, 8)], [])
    assert (t["H2D"].busy_us, t["H2D"].hidden_us) == (10.0, 0.0)
    s = step_trace.transfer_summary({}, steps=1, wall_ms=5.0)
    assert s["transfer_ms"] == 0 and s["hidden_ms"] == 0
    import train_bench

    assert train_bench.transfer_cell(s) == "0.0 / 0.0 (-)"


def test_offload_rows_config_sections_are_accepted_by_the_config():
    import argparse

    import deepcompile.config as dc_config
    import train_bench

    args = argparse.Namespace(memory_budget_gib=None, memory_budget_fraction=0.9)
    assert train_bench.offload_config(args, "none") == {"zero_optimization": {}, "compile": {}}
    assert train_bench.offload_config(args, "optimizer") == {
        "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}, "compile": {}}
    assert train_bench.offload_config(args, "budget") == {
        "zero_optimization": {}, "compile": {"offload_opt_states": True, "memory_budget_fraction": 0.9}}
    assert train_bench.offload_config(args, "all")["compile"] == {
        "offload_opt_states": True, "offload_activation": True, "offload_parameters": True,
        "memory_budget_fraction": 0.9}
    # Explicit bytes (offload_bench's measured budget) replace the fraction; --memory-budget-gib
    # is set by the row's base config, so no fraction is added next to it.
    assert train_bench.offload_config(args, "budget", budget_bytes=5 << 30)["compile"]["memory_budget_bytes"] == 5 << 30
    args.memory_budget_gib = 70.0
    assert "memory_budget_fraction" not in train_bench.offload_config(args, "budget")["compile"]
    with pytest.raises(ValueError, match="unknown offload kind"):
        train_bench.offload_config(args, "nvme")
    # The two rows the project implements must pass its config validation as the rows build them.
    for kind in ("optimizer", "budget"):
        sections = train_bench.offload_config(argparse.Namespace(memory_budget_gib=None, memory_budget_fraction=0.9), kind)
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 3, **sections["zero_optimization"]}, "compile": sections["compile"]}
        parsed = dc_config.Config.from_any(cfg)
        assert parsed.compile.offload_opt_states == (kind == "budget")
        assert (parsed.zero_optimization.offload_optimizer is not None) == (kind == "optimizer")


def test_7b_preset_is_the_issue_model_and_isolates_its_rows():
    import train_bench

    args = train_bench.parse_args(["--preset", "7b"])
    assert (args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab) == \
        (4096, 32, 32, 32, 11008, 32000)
    assert (args.micro_batch, args.seq, args.init, args.isolate, args.pcie) == (1, 2048, "meta", True, True)
    assert train_bench.parse_args(["--methods", "z3,fsdp2"]).pcie is False  # no offload row: no PCIe measurement
    assert train_bench.parse_args(["--methods", "z3", "--pcie"]).pcie is True
    assert args.methods == ["fsdp2-offload", "z3-offload", "z3-offload-budget", "z3-offload-all"]
    assert train_bench.count_params(args) == pytest.approx(6.74e9, rel=1e-3)  # the issue's 6.74 B
    # Explicit options still win over the preset.
    assert train_bench.parse_args(["--preset", "7b", "--layers", "40", "--no-isolate"]).layers == 40
    with pytest.raises(SystemExit):  # profile-guided offload passes need the re-plan's warm-up steps
        train_bench.parse_args(["--preset", "7b", "--offload-passes", "prefetch", "--warmup", "2"])


def test_row_table_shows_offload_columns_and_the_speedup_over_fsdp2_offload():
    import train_bench

    Row = train_bench.Row
    s = {"step_ms": 2000.0, "h2d_ms": 300.0, "h2d_hidden_ms": 270.0, "h2d_gb": 6.0, "d2h_ms": 200.0,
         "d2h_hidden_ms": 180.0, "d2h_gb": 4.0, "transfer_ms": 500.0, "hidden_ms": 450.0}
    rows = [Row(train_bench.FSDP2_OFFLOAD_NAME, tokens_per_s=200.0, step_ms=10_000.0, host_peak_gib=110.0),
            Row(train_bench.METHODS["z3-offload-budget"].name, tokens_per_s=1400.0, step_ms=1463.0, transfers=s),
            Row(train_bench.METHODS["z3-offload-all"].name, status="n/a", note="unavailable: no")]
    train_bench.compare_with_fsdp2_offload(rows)
    assert rows[0].vs_fsdp2_offload == pytest.approx(1.0) and rows[1].vs_fsdp2_offload == pytest.approx(7.0)
    assert rows[2].vs_fsdp2_offload is None
    pcie = {"both_h2d_gb_s": 20.0, "both_d2h_gb_s": 20.0}
    table = train_bench.markdown_table(rows, pcie).splitlines()
    assert len({line.count(" | ") for line in table}) == 1, "a row has another number of cells than the header"
    head = [c.strip() for c in table[0].strip("|").split("|")]
    ours = dict(zip(head, [c.strip() for c in table[3].strip("|").split("|")]))
    assert ours["× FSDP2 offload tokens/s"] == "7.00"
    assert ours["transfer / hidden ms (%)"] == "500.0 / 450.0 (90 %)"
    assert ours["GB moved/step"] == "10.00" and ours["PCIe floor (ms)"] == "300.0"  # 6 GB / 20 GB/s
    assert dict(zip(head, [c.strip() for c in table[4].strip("|").split("|")]))["note"] == "unavailable: no"
    # Without any offload data the table keeps its old columns.
    assert train_bench.columns([Row("x", step_ms=1.0)]) == train_bench.COLUMNS


def test_a_row_process_that_gave_no_row_says_why():
    import row_process

    assert row_process.failure(None, ["compiling"], 60) == ("timeout", "no result within 60 s")
    killed = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "  exitcode  : -9 (pid: 7)",
              "  error_file: <N/A>", "  traceback : Signal 9 (SIGKILL) received by PID 7"]
    status, note = row_process.failure(1, killed, None)
    assert status == "killed" and note.startswith("killed by SIGKILL (host out of memory?)")
    assert row_process.failure(-9, [], None)[0] == "killed"
    assert row_process.failure(1, ["Traceback", "RuntimeError: boom", "done"], None) == \
        ("error", "exit 1: RuntimeError: boom")
    cmd = row_process.child_command(["--preset", "7b", "--methods", "a,b"], "z3-offload", 2, "/tmp/r.json")
    # The row's overrides come after the parent's options (argparse: the last one wins).
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--child-json") - 4:] == ["--methods", "z3-offload", "--no-isolate", "--no-pcie",
                                                    "--child-json", "/tmp/r.json"]


def _fsdp2_meta_init_body(ctx):
    import argparse

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import train_bench

    args = train_bench.parse_args(["--preset", "tiny", "--init", "meta", "--methods", "fsdp2"])
    bench_ctx = train_bench.Context(args, torch.device("cpu"), "eager", ctx.rank, ctx.world_size, [], 0)
    model = train_bench.build_meta_model(bench_ctx, torch.float32)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    train_bench.init_local_shards(model, model._init_weights)
    # The reference: the same model unsharded, initialised by the same loop from the same seed.
    ref = train_bench.build_meta_model(bench_ctx, torch.float32)
    ref.to_empty(device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        for module in ref.modules():
            ref._init_weights(module)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert type(p).__name__ == "DTensor", name  # still FSDP2's sharded parameter after the init
        # One rank: the shard is the whole parameter, drawn in the same order: bit-identical.
        assert torch.equal(p.full_tensor(), want[name].detach()), name
    for name, b in model.named_buffers():
        assert torch.equal(b, dict(ref.named_buffers())[name]), name  # rotary inv_freq recomputed


@pytest.mark.world_size(1)
def test_fsdp2_meta_init_writes_every_shard_like_an_unsharded_init():
    from _harness.multiproc import run_distributed

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    run_distributed(_fsdp2_meta_init_body, 1, timeout=300)


def _train_bench(args, timeout=600):
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_bench.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.world_size(1)  # row processes of --nproc 1 (the default)
def test_isolated_offload_rows_run_on_cpu_each_in_its_own_process(tmp_path):
    """train_bench.py --isolate with the offload rows on the tiny model (one rank, gloo, meta init),
    3 steps on one repeated batch (--same-batch): every row comes back from its own process and the
    table holds all of them: z3-offload trains, its loss falling at every step and matching, step
    by step, FSDP2's CPU offload (unpinned on CPU), which trains the same model from its sharded
    meta init with torch's own code and is the peer the speed-up column divides by; the
    all-kinds row either trains or says which setting this build refuses.

    Tolerances: the first loss is the initial model's (no update yet), both in bf16: they agree
    within 1e-3 (measured 2e-4), where an all-zero model (ln(256) = 5.5452 exactly) would be
    1e-2 off; later steps within 5e-3 (measured 2e-3 after two AdamW steps of lr 1e-3, which
    each lower the loss by about 0.15)."""
    import json
    import math

    out, trace = tmp_path / "rows.json", tmp_path / "trace"
    proc = _train_bench(["--preset", "tiny", "--isolate", "--init", "meta", "--warmup", "1", "--steps", "2",
                         "--same-batch", "--lr", "1e-3",
                         "--methods", "z3-offload,z3-offload-all,fsdp2-offload", "--trace", str(trace),
                         "--trace-steps", "1", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    z3 = rows["deepcompile ZeRO-3 + offload_optimizer"]
    assert z3["status"] == "ok", z3
    fsdp2 = rows["FSDP2 + CPU offload + compile"]
    assert fsdp2["status"] == "ok", fsdp2
    losses, reference = z3["losses"], fsdp2["losses"]
    assert len(losses) == len(reference) == 3 and z3["loss"] == losses[-1], (losses, reference)
    assert all(math.isfinite(v) for v in losses + reference), (losses, reference)
    assert all(b < a - 0.05 for a, b in zip(losses, losses[1:])), f"the loss does not fall: {losses}"
    assert abs(losses[0] - reference[0]) < 1e-3, f"initial model differs from FSDP2's: {losses} vs {reference}"
    assert all(abs(a - b) < 5e-3 for a, b in zip(losses, reference)), f"z3-offload {losses} vs FSDP2 {reference}"
    assert "opt states offloaded" in z3["note"] and z3["host_peak_gib"] > 0
    # The engine's bytes per link of the last measured step reach the row (one rank: the shard
    # link only, nothing on the wire); the peer has none. Plain rows keep their labels.
    shard = z3["comm_bytes"]["shard"]
    assert set(z3["comm_bytes"]) == {"shard"} and shard["ranks"] == 1 and shard["wire"] == 0, z3["comm_bytes"]
    assert shard["all_gather"] > 0 and shard["reduce_scatter"] > 0, shard
    assert fsdp2["comm_bytes"] is None and z3["layout"] is None
    assert z3["transfers"]["transfer_ms"] == 0  # a CPU run has no host-device copies to find in its trace
    assert "H2D copies busy" in (trace / "z3-offload.txt").read_text()
    everything = rows["deepcompile ZeRO-3 + all offload kinds, budget"]
    assert everything["status"] == "ok" or (everything["status"] == "n/a"
                                            and everything["note"].startswith("unavailable: ")), everything
    assert fsdp2["vs_fsdp2_offload"] == 1.0 and z3["vs_fsdp2_offload"] > 0
    assert "isolation: one torchrun process per row" in proc.stdout
    assert result["env"]["init"].startswith("built on meta")


def test_isolated_row_past_its_timeout_is_a_timeout_row(tmp_path, monkeypatch):
    """train_bench.py --isolate --row-timeout 1 whose row process never ends by itself: it waits for
    a signal, so only the parent's timeout stops it, however fast or slow the machine (no race
    between the timeout and a real row). The row says timeout, and the table still comes out."""
    import json

    import row_process
    import train_bench

    never_ends = [sys.executable, "-c", "import signal\nwhile True:\n    signal.pause()"]
    monkeypatch.setattr(row_process, "child_command", lambda argv, key, nproc, out: never_ends)
    # run_isolated installs a SIGTERM handler for a bench process; pytest's own stays as it is.
    monkeypatch.setattr(row_process, "stop_children_on_termination", lambda: None)
    out = tmp_path / "rows.json"
    assert train_bench.main(["--preset", "tiny", "--isolate", "--methods", "z3", "--warmup", "1", "--steps", "1",
                             "--row-timeout", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["method"], row["status"], row["note"]) == ("deepcompile ZeRO-3", "timeout", "no result within 1 s")


def test_largest_model_search_order():
    import largest_model

    nxt = largest_model.next_try
    assert nxt([32, 40, 48], {}, "linear") == 32
    assert nxt([32, 40, 48], {32: True}, "linear") == 40
    assert nxt([32, 40, 48], {32: True, 40: False}, "linear") is None  # 32 trains, 40 fails: known
    assert nxt([32, 40, 48], {32: False}, "linear") is None  # nothing tried trains
    assert nxt([32, 40, 48], {32: True, 40: True, 48: True}, "linear") is None
    layers = [16, 24, 32, 40, 48, 56, 64]
    assert nxt(layers, {}, "binary") == 40
    assert nxt(layers, {40: True}, "binary") == 56
    assert nxt(layers, {40: True, 56: False}, "binary") == 48
    assert nxt(layers, {40: True, 56: False, 48: True}, "binary") is None
    assert nxt(layers, {40: False}, "binary") == 24


@pytest.mark.world_size(1)  # tries of --nproc 1 (the default)
def test_largest_model_reports_what_trains_and_why_the_rest_fails_on_cpu(tmp_path):
    """bench/largest_model.py end to end on CPU with a tiny 7B-shaped stand-in (2 layers of width
    64): deepcompile ZeRO-3 trains at the largest count tried (binary search: one try); the
    profile-guided z3-prefetch row refuses the tries' 2 warm-up steps (it needs 3), so it fails at
    both counts (tried from the middle down), and the report quotes the error."""
    import json
    import subprocess

    out, md = tmp_path / "largest.json", tmp_path / "largest.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "largest_model.py"), "--systems", "z3,z3-prefetch",
         "--layers", "1,2", "--search", "binary", "--timeout", "300", "--json", str(out), "--markdown", str(md),
         "--", "--hidden", "64", "--heads", "4", "--intermediate", "172", "--vocab", "256", "--seq", "64"],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    z3, prefetch = json.loads(out.read_text())["systems"]
    assert z3["tried"] == [2] and z3["largest"]["layers"] == 2 and z3["first_failure"] is None
    assert z3["largest"]["status"] == "ok" and z3["largest"]["params"] > 0
    assert prefetch["largest"] is None and prefetch["tried"] == [2, 1]  # bisects down to the smallest count
    failure = prefetch["first_failure"]
    assert failure["layers"] == 1 and failure["status"] == "error"
    assert failure["note"].startswith("exit ") and "--warmup must be >= 3" in failure["note"]
    assert "| deepcompile ZeRO-3 + prefetch | none tried trains |" in md.read_text()


def test_merge_joins_the_tables_of_separate_runs_and_takes_the_ratio_across_them(tmp_path):
    import argparse
    import json

    import train_bench

    Row = train_bench.Row
    env = {"date (UTC)": "2026-11-25 02:00", "device": "1 x GPU", "command": "python3 bench/train_bench.py ..."}
    pcie = {"bytes_per_copy": 1 << 30, "repeats": 5, "h2d_gb_s": 25.0, "d2h_gb_s": 26.0, "both_h2d_gb_s": 20.0,
            "both_d2h_gb_s": 20.0, "both_total_gb_s": 40.0}
    a, b = tmp_path / "fsdp2.json", tmp_path / "z3.json"
    train_bench.write_json(str(a), env, [Row(train_bench.FSDP2_OFFLOAD_NAME, tokens_per_s=200.0, step_ms=10240.0)],
                           pcie)
    train_bench.write_json(str(b), env, [Row(train_bench.METHODS["z3-offload"].name, tokens_per_s=1000.0,
                                             step_ms=2048.0, vs_fsdp2_offload=123.0)], None)
    out = tmp_path / "merged.json"
    assert train_bench.main(["--merge", str(a), str(b), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [r["method"] for r in merged["rows"]] == [train_bench.FSDP2_OFFLOAD_NAME,
                                                     train_bench.METHODS["z3-offload"].name]
    # The stale ratio of part 2 (no peer in its own run) is replaced by the one across both parts.
    assert merged["rows"][1]["vs_fsdp2_offload"] == pytest.approx(5.0)
    assert merged["pcie"] == pcie and merged["env"]["part 2"].startswith(str(b))


@pytest.mark.world_size(1)  # a row process of --nproc 1 (the default)
def test_stopping_an_isolated_run_stops_its_row_process(tmp_path):
    """``timeout`` around the whole run sends SIGTERM to the parent only; the row process runs in
    a session of its own and must be stopped with it, or it keeps the device for the next command."""
    import signal
    import subprocess
    import time

    marker = "918273"  # a seed no other process uses: finds the row process in /proc
    parent = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "train_bench.py"), "--preset", "tiny",
                               "--isolate", "--methods", "z3", "--seed", marker, "--warmup", "1", "--steps", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def row_processes():
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != parent.pid:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        args = f.read().split(b"\0")
                except OSError:
                    continue
                if marker.encode() in args and b"--child-json" in args:
                    found.append(int(pid))
        return found

    try:
        deadline = time.monotonic() + 120
        while not row_processes():
            assert parent.poll() is None and time.monotonic() < deadline, "the row process never started"
            time.sleep(0.2)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=120) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 60
        while row_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert row_processes() == []
    finally:
        if parent.poll() is None:
            parent.kill()


# ---- compile_time.py: per-phase time to the first scheduled step --------------------------------


class _ManualClock:
    """A clock that moves only when told (``advance``): phase times become exact numbers."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def test_compile_time_charges_nested_phases_exclusively():
    import types

    import compile_time

    now = _ManualClock()
    clock = compile_time.PhaseClock(now=now)
    holder = types.SimpleNamespace()
    holder.inner = lambda: now.advance(3)
    holder.outer = lambda: (now.advance(5), holder.inner(), now.advance(2))
    module = types.ModuleType("compile_time_probe")
    module.inner, module.outer = holder.inner, holder.outer
    sys.modules["compile_time_probe"] = module
    try:
        clock.wrap("compile_time_probe", "inner", "inner phase")
        clock.wrap("compile_time_probe", "outer", "outer phase")
        holder.inner = module.inner  # outer calls the wrapped inner through holder
        start = now()
        module.outer()
        wall = now() - start
        now.advance(7)  # after the call: charged to no phase
        module.inner()  # a phase entered at top level
        clock.unwrap()
    finally:
        del sys.modules["compile_time_probe"]
    # Exclusive: the outer phase is charged its own 5 + 2 s, not the inner one's 3 s again, and the
    # two phases add up to the call's time exactly.
    assert wall == 10
    assert clock.calls == {"outer phase": 1, "inner phase": 2}
    assert clock.seconds == {"outer phase": 7, "inner phase": 3 + 3}
    assert module.outer is holder.outer  # unwrap restored the originals


def test_compile_time_wraps_names_that_exist():
    """Every phase names a function where its callers find it in this torch and deepcompile: a
    missing one would silently drop a phase from the table."""
    import compile_time

    clock = compile_time.PhaseClock()
    try:
        compile_time.install(clock)  # raises AttributeError / KeyError on a missing name
        assert len(clock._undo) == len(compile_time.PHASES)
    finally:
        clock.unwrap()
