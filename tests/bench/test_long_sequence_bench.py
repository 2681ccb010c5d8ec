"""bench/long_sequence_bench.py on CPU: the driver starts one torchrun child (2 gloo ranks) per
(system, length), the tiny preset trains under deepcompile's Ulysses sequence parallelism, and the
rows that are not run say why (a length that does not divide by the ranks, DeepSpeed absent, an
unknown system). One driver run, two short trainings: about 30-60 s on 2 cores."""

from __future__ import annotations

import json
import sys

import pytest

from _harness.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import long_sequence_bench as bench  # noqa: E402
import row_process  # noqa: E402


@pytest.fixture
def cpu_only(monkeypatch):
    """The children on gloo even where GPUs exist; DeepSpeed hidden from the driver (its rows n/a)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(bench, "cuda_available", lambda: False)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # find_spec("deepspeed") answers None
    monkeypatch.setattr(row_process, "stop_children_on_termination", lambda: None)  # pytest keeps its SIGTERM


@pytest.mark.world_size(2)  # one torchrun child of 2 ranks per row
def test_dc_trains_two_lengths_and_the_other_rows_say_why(cpu_only, tmp_path, capsys):
    out, md = tmp_path / "rows.json", tmp_path / "table.md"
    code = bench.main(["--preset", "tiny", "--nproc", "2", "--systems", "dc,ds-alst", "--seqs", "64,65,128",
                       "--warmup", "1", "--steps", "1", "--timeout", "240", "--json", str(out), "--markdown", str(md)])
    assert code == 0
    systems = {s["system"]: s for s in json.loads(out.read_text())["systems"]}
    dc = {r["seq"]: r for r in systems["dc"]["rows"]}
    for seq in (64, 128):
        assert dc[seq]["status"] == "ok", dc[seq]
        assert dc[seq]["tokens_per_s"] > 0 and dc[seq]["step_ms"] > 0
        assert 4.0 < dc[seq]["loss"] < 7.0  # near ln(256) on random tokens
    assert systems["dc"]["longest"]["seq"] == 128
    assert dc[65]["status"] == "refused" and "does not divide by sequence_parallel_size 2" in dc[65]["note"]
    ds = {r["seq"]: r for r in systems["ds-alst"]["rows"]}
    assert {ds[64]["status"], ds[128]["status"]} == {"n/a"} and "deepspeed" in ds[64]["note"]
    assert ds[65]["status"] == "refused"
    table = md.read_text()
    assert "longest sequence that trains" in table and "n/a: deepspeed is not importable here" in table
    assert "| deepcompile ZeRO-3 + Ulysses SP | 128 | none tried fails |" in table


def test_unknown_system_and_bad_options_are_refused(capsys):
    for argv, message in ((["--systems", "dc,fsdp2-cp"], "unknown ['fsdp2-cp']"),
                          (["--seqs", "64,abc"], "comma list of integers"),
                          (["--dc-compile-set", "offload_activation"], "key=value")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv + ["--nproc", "2", "--preset", "tiny"])
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_compile_set_values_are_json_and_only_dc_children_get_them():
    args = bench.parse_args(["--preset", "tiny", "--nproc", "2", "--dc-compile-set", "offload_activation=true",
                             "--dc-compile-set", "memory_budget_fraction=0.8", "--dc-compile-set", "x=name"])
    assert args.compile_set == {"offload_activation": True, "memory_budget_fraction": 0.8, "x": "name"}
    dc = bench.child_command(args, "dc", 64, "/tmp/row.json")
    ds = bench.child_command(args, "ds-alst", 64, "/tmp/row.json")
    assert dc.count("--dc-compile-set") == 3 and "--dc-compile-set" not in ds
    assert dc[dc.index("--nproc-per-node") + 1] == "2" and "--worker" in dc
