"""train_bench's layouts of the deepcompile rows (hybrid sharding, hpZ; bench/layouts.py) and its
bytes-per-link column, read from the configs and tables it builds (no engine, no process group:
the end-to-end row with real counts is test_bench_tools.py's isolated offload run)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from _harness.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import layouts  # noqa: E402
import train_bench as tb  # noqa: E402


def test_layout_tokens_name_the_zero_keys_and_the_label():
    assert layouts.parse("plain") == layouts.Layout() and layouts.Layout().zero_keys() == {}
    hybrid = layouts.parse("2x1")
    assert hybrid.zero_keys() == {"mics_shard_size": 1} and hybrid.label() == "2x1"
    assert layouts.parse("HPZ2").zero_keys() == {"zero_hpz_partition_size": 2}
    both = layouts.parse("2x4+hpz4")
    assert both.zero_keys() == {"mics_shard_size": 4, "zero_hpz_partition_size": 4} and both.label() == "2x4, hpZ 4"
    assert layouts.Layout(shard_group_size=2).label() == "shard group 2"  # --shard-group-size: no R written
    for bad in ("3y1", "hpz0", "0x2", "2x1+2x1", "hpz2+hpz2", ""):
        with pytest.raises(ValueError, match="layout"):
            layouts.parse(bad)
    # RxS must be the world: 2x1 written for 2 GPUs is not run as 4x1 on 4.
    assert hybrid.world_error(2) is None and "needs 2 ranks" in hybrid.world_error(4)
    assert layouts.parse("hpz2").world_error(4) is None  # the config checks what it needs of the world


def test_layouts_give_each_deepcompile_method_one_labelled_row_and_leave_the_peers_alone():
    args = tb.parse_args(["--methods", "z3-prefetch,fsdp2,z1,ddp", "--layouts", "plain,2x1"])
    assert args.methods == ["z3-prefetch@plain", "z3-prefetch@2x1", "fsdp2", "z1@plain", "z1@2x1", "ddp"]
    rows = [tb.method_of(k, args) for k in args.methods]
    assert [m.name for m in rows] == [
        "deepcompile ZeRO-3 + prefetch [plain]", "deepcompile ZeRO-3 + prefetch [2x1]", tb.FSDP2_NAME,
        "deepcompile ZeRO-1 [plain]", "deepcompile ZeRO-1 [2x1]", "DDP + compile"]
    assert [m.layout for m in rows] == ["plain", "2x1", None, "plain", "2x1", None]
    assert tb.method_of("fsdp2", args) is tb.METHODS["fsdp2"]  # the ratio to FSDP2 still finds its row
    # A row's own layout is kept (an --isolate row process is given its key so) and not expanded again.
    assert tb.parse_args(["--methods", "z3@hpz2,z3", "--layouts", "plain,2x1"]).methods == \
        ["z3@hpz2", "z3@plain", "z3@2x1"]
    # Without any layout option the rows keep their labels and keys (tables comparable with older runs).
    plain = tb.parse_args(["--methods", "z3,fsdp2"])
    assert plain.methods == ["z3", "fsdp2"] and tb.method_of("z3", plain) is tb.METHODS["z3"]
    # --shard-group-size / --hpz-partition-size: one layout for every deepcompile row, in its label.
    opts = tb.parse_args(["--methods", "z3,z1,fsdp2", "--shard-group-size", "1"])
    assert [tb.method_of(k, opts).name for k in opts.methods] == [
        "deepcompile ZeRO-3 [shard group 1]", "deepcompile ZeRO-1 [shard group 1]", tb.FSDP2_NAME]


def _built_configs(monkeypatch, args, keys, world):
    """The config each row of ``keys`` would hand to deepcompile.initialize, on ``world`` ranks:
    the methods' builds replaced by one that only records deepcompile_config of the row's options."""
    seen = {}
    for key in keys:
        base = layouts.split_key(key)[0]
        stage = tb.METHODS[base].stage
        monkeypatch.setitem(tb.METHODS, base, dataclasses.replace(
            tb.METHODS[base], build=lambda ctx, stage=stage: tb.deepcompile_config(ctx.args, stage)))
    for key in keys:
        ctx = tb.Context(args, torch.device("cpu"), "eager", 0, world, [], 0)
        seen[key] = tb.method_of(key, args).build(ctx)
    return seen


def test_each_rows_layout_reaches_its_config_and_nothing_else_changes(monkeypatch):
    args = tb.parse_args(["--methods", "z3,z2", "--layouts", "plain,2x1"])
    args.methods += ["z3@hpz2", "z3@2x1+hpz2"]
    configs = _built_configs(monkeypatch, args, args.methods, world=2)
    zero = {k: c["zero_optimization"] for k, c in configs.items()}
    assert zero["z3@plain"] == tb.deepcompile_config(tb.parse_args(["--methods", "z3"]), 3)["zero_optimization"]
    assert "mics_shard_size" not in zero["z3@plain"] and "zero_hpz_partition_size" not in zero["z3@plain"]
    assert zero["z3@2x1"]["mics_shard_size"] == 1 and zero["z2@2x1"]["mics_shard_size"] == 1
    assert zero["z3@hpz2"]["zero_hpz_partition_size"] == 2 and "mics_shard_size" not in zero["z3@hpz2"]
    assert (zero["z3@2x1+hpz2"]["mics_shard_size"], zero["z3@2x1+hpz2"]["zero_hpz_partition_size"]) == (1, 2)
    # Apart from the layout's keys, every row's config is the plain row's.
    for key, z in zero.items():
        assert {k: v for k, v in z.items() if k not in ("mics_shard_size", "zero_hpz_partition_size", "stage")} == \
            {k: v for k, v in zero["z3@plain"].items() if k != "stage"}, key
    # A 2x1 row on 4 ranks is refused by its build (the table says why), not run as another layout.
    with pytest.raises(ValueError, match="needs 2 ranks"):
        _built_configs(monkeypatch, args, ["z3@2x1"], world=4)
    # The options give the same keys to every deepcompile row; hpZ is ZeRO-3's only.
    opts = tb.parse_args(["--methods", "z3", "--shard-group-size", "2", "--hpz-partition-size", "2"])
    assert {k: opts_z for k, opts_z in tb.deepcompile_config(opts, 3)["zero_optimization"].items()
            if k in ("mics_shard_size", "zero_hpz_partition_size")} == {"mics_shard_size": 2,
                                                                         "zero_hpz_partition_size": 2}
    with pytest.raises(ValueError, match="ZeRO-3 only"):
        tb.deepcompile_config(opts, 1)


def test_peer_rows_ignore_the_layout_options():
    import deepspeed_peer

    opts = tb.parse_args(["--methods", "z3", "--shard-group-size", "1", "--hpz-partition-size", "2"])
    plain = tb.parse_args(["--methods", "z3"])
    adamw = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    for key in ("ds-z3", "ds-dc"):
        assert deepspeed_peer.deepspeed_config(opts, key, adamw, False) == \
            deepspeed_peer.deepspeed_config(plain, key, adamw, False), key


def test_layout_keys_are_read_by_deepcompiles_config():
    """The bench passes the keys through and deepcompile's config reads both: hybrid sharding's and
    hpZ's (implemented: tests/parity/test_hpz.py). A refusal of either fails here (it used to be
    accepted for hpZ, which made the test pass whether the key was read or refused)."""
    import deepcompile.config as dc_config

    args = tb.parse_args(["--methods", "z3"])
    hybrid = tb.deepcompile_config(layouts.with_layout(args, layouts.parse("2x1")), 3)
    assert dc_config.Config.from_any(hybrid).zero_optimization.mics_shard_size == 1
    hpz = tb.deepcompile_config(layouts.with_layout(args, layouts.parse("hpz2")), 3)
    parsed = dc_config.Config.from_any(hpz)
    assert parsed.zero_optimization.zero_hpz_partition_size == 2
    # Resolved on a world it divides (what a 4-GPU bench row runs), the key survives; on one it
    # does not divide, the refusal names it (the row's note).
    assert parsed.resolve(4).zero_optimization.zero_hpz_partition_size == 2
    with pytest.raises(Exception, match="zero_hpz_partition_size"):
        parsed.resolve(3)


@pytest.mark.parametrize("argv, message", [
    (["--methods", "z3,z1", "--hpz-partition-size", "2"], "hpZ .* is ZeRO-3 only, z1 is ZeRO-1"),
    (["--methods", "z3,z2", "--layouts", "plain,hpz2"], "z2@hpz2: hpZ .* is ZeRO-3 only"),
    (["--methods", "fsdp2@2x1"], "layouts apply to deepcompile rows only"),
    (["--methods", "z3", "--layouts", "2x1", "--shard-group-size", "1"], "either --layouts or"),
    (["--methods", "z3", "--layouts", "plain,2by1"], "expected plain, RxS"),
    (["--methods", "z3", "--shard-group-size", "0"], "--shard-group-size must be"),
    (["--methods", "z3", "--hpz-partition-size", "0"], "--hpz-partition-size must be"),
    (["--isolate", "--nproc", "2", "--methods", "z3", "--layouts", "2x2"], "needs 4 ranks"),
])
def test_layout_options_are_refused_where_they_cannot_apply(capsys, argv, message):
    import re

    with pytest.raises(SystemExit):
        tb.parse_args(argv)
    assert re.search(message, capsys.readouterr().err), argv


def test_a_run_whose_world_does_not_fit_a_layout_stops_before_any_row():
    args = tb.parse_args(["--methods", "z3,fsdp2", "--layouts", "plain,2x1"])
    assert layouts.world_errors(args.methods, args, 2) == []
    (error,) = layouts.world_errors(args.methods, args, 4)
    assert error.startswith("z3@2x1: layout 2x1 needs 2 ranks")


def test_bytes_per_link_column_shows_each_link_in_gb_per_step(tmp_path):
    Row = tb.Row
    two_links = {"shard": {"ranks": 1, "all_gather": 4_000_000_000, "wire": 0},
                 "replica": {"ranks": 2, "all_reduce": 1_500_000_000, "wire": 1_500_000_000}}
    rows = [Row("deepcompile ZeRO-3 [plain]", step_ms=10.0, layout="plain",
                comm_bytes={"shard": {"ranks": 2, "all_gather": 2_000_000_000, "wire": 2_500_000_000}}),
            Row("deepcompile ZeRO-3 [2x1]", step_ms=12.0, layout="2x1", comm_bytes=two_links),
            Row("deepcompile ZeRO-3 [hpZ 2]", step_ms=9.0, layout="hpZ 2",
                comm_bytes={"shard": {"wire": 1_000_000_000}, "secondary": {"wire": 250_000_000}}),
            Row("deepcompile ZeRO-3 [4x1]", status="error", note="ValueError: layout"),
            Row(tb.FSDP2_NAME, step_ms=11.0)]
    table = tb.markdown_table(rows).splitlines()
    assert len({line.count(" | ") for line in table}) == 1, "a row has another number of cells than the header"
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head.index(layouts.COMM_COLUMN) == head.index("loss") - 1
    column = [[c.strip() for c in line.strip("|").split("|")][head.index(layouts.COMM_COLUMN)] for line in table[2:]]
    assert column == ["2.50 / - / -", "0.00 / 1.50 / -", "1.00 / - / 0.25", "error", "n/a"]
    assert layouts.comm_cell({"shard": {"wire": 396_000}}) == "0.000396 / - / -"  # tiny models: 3 digits
    assert layouts.comm_cell({"shard": {"wire": 0}, "node": {"wire": 2e9}}) == "0.00 / - / - / node 2.00"
    # No row with counts (peers only, or an older JSON): the table keeps its columns.
    assert tb.columns([Row(tb.FSDP2_NAME, step_ms=1.0)]) == tb.COLUMNS
    # The JSON keeps the layout and the full counts; --merge reads them back.
    part = tmp_path / "part.json"
    tb.write_json(str(part), {"date (UTC)": "2026-11-27 02:00", "device": "2 x GPU"}, rows[:2], None)
    out = tmp_path / "merged.json"
    assert tb.main(["--merge", str(part), "--json", str(out)]) == 0
    import json

    merged = json.loads(out.read_text())["rows"]
    assert merged[1]["layout"] == "2x1" and merged[1]["comm_bytes"] == two_links


def test_a_row_keeps_the_bytes_of_its_last_measured_step(monkeypatch):
    """Through measure() and combine(): the counts read after the last measured step (each step
    here counts 1000 bytes more than the one before: 2 warm-up + 2 measured steps give 4000)."""
    import argparse

    import train_measure

    monkeypatch.setattr(train_measure, "teardown", lambda ctx: None)  # no process group here (measure's own)
    steps = []

    def build(ctx):
        def step(tokens):
            steps.append(len(steps))
            return torch.ones(())

        return tb.Runner(step, comm_bytes=lambda: {"shard": {"ranks": 1, "wire": 1000 * len(steps)}})

    args = argparse.Namespace(compile_cache="shared", warmup=2, steps=2, trace=None, memory_history=None,
                              warm_start=False, micro_batch=1, seq=4, layers=1, hidden=4)
    ctx = tb.Context(args, torch.device("cpu"), "eager", 0, 1, [torch.zeros(1, 4, dtype=torch.long)] * 4, 10)
    method = tb.Method("fake [2x1]", build, key="fake", stage=3, layout="2x1")
    m = tb.measure(ctx, method)
    assert m.status == "ok", m.note
    row = tb.combine(ctx, method, [m])
    assert (row.layout, row.comm_bytes) == ("2x1", {"shard": {"ranks": 1, "wire": 4000}})
