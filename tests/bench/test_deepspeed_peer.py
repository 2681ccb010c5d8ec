"""DeepSpeed's rows of bench/train_bench.py without DeepSpeed: the DeepSpeed config each row builds
from train_bench's options (bench/deepspeed_peer.py), the options that keep those rows apart from
deepcompile's process, --peer-repeats (bench/peer_rows.py), and the row a run without DeepSpeed gets."""

from __future__ import annotations

import sys
import types

import pytest

from _harness.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import deepspeed_peer  # noqa: E402
import peer_rows  # noqa: E402
import train_bench  # noqa: E402

ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def _args(*extra):
    return train_bench.parse_args(["--preset", "tiny", "--isolate", "--warmup", "7", "--methods", "ds-z3", *extra])


def test_every_row_takes_the_deepcompile_rows_settings_from_the_same_options():
    args = _args("--micro-batch", "3", "--reduce-bucket-size", "12345", "--persistence-threshold", "678",
                 "--sub-group-size", "9e6", "--communication-data-type", "bf16")
    for key in deepspeed_peer.VARIANTS:
        config = deepspeed_peer.deepspeed_config(args, key, ADAMW, pin_memory=True)
        zero = config["zero_optimization"]
        assert (zero["stage"], zero["reduce_bucket_size"], zero["stage3_param_persistence_threshold"],
                zero["sub_group_size"]) == (3, 12345, 678, 9_000_000), key
        assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 1)
        assert config["bf16"] == {"enabled": True} and config["communication_data_type"] == "bf16"
    # Options not given are not set: DeepSpeed's own defaults apply, as the library's do for deepcompile.
    plain = deepspeed_peer.deepspeed_config(_args(), "ds-z3", ADAMW, pin_memory=True)
    assert "sub_group_size" not in plain["zero_optimization"] and "communication_data_type" not in plain
    zero = plain["zero_optimization"]  # the tiny preset's values, as its deepcompile rows get them
    assert (zero["reduce_bucket_size"], zero["stage3_param_persistence_threshold"]) == (20_000, 1_000)


def test_offload_and_deepcompile_sections_per_row():
    args = _args()
    build = lambda key, pin=True: deepspeed_peer.deepspeed_config(args, key, ADAMW, pin_memory=pin)
    assert "compile" not in build("ds-z3") and "optimizer" not in build("ds-z3")
    assert not any(k.startswith("offload_") for k in build("ds-z3")["zero_optimization"])
    host = {"device": "cpu", "pin_memory": True}
    z3_opt = build("ds-z3-offload-opt")
    assert z3_opt["zero_optimization"]["offload_optimizer"] == host
    assert "offload_param" not in z3_opt["zero_optimization"]
    # ZeRO offload refuses a client optimizer: the config names AdamW with the same hyper-parameters.
    assert z3_opt["optimizer"] == {"type": "AdamW", "params": ADAMW}
    both = build("ds-z3-offload", pin=False)  # CPU runs do not pin
    assert both["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert both["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert build("ds-dc")["compile"] == {"deepcompile": True} and "optimizer" not in build("ds-dc")
    for key, option in (("ds-dc-offload-opt", "offload_opt_states"), ("ds-dc-offload-param", "offload_parameters"),
                        ("ds-dc-offload-act", "offload_activation")):
        config = build(key)
        assert config["compile"] == {"deepcompile": True, option: True}, key
        # DeepCompile's offload keeps ZeRO's offload off (DeepSpeed refuses offload_opt_states with it).
        assert not any(k.startswith("offload_") for k in config["zero_optimization"]) and "optimizer" not in config


def test_adamw_hyper_parameters_are_train_benchs_optimizer():
    import torch

    args = _args("--lr", "3e-4")
    optimizer = train_bench.make_optimizer(types.SimpleNamespace(args=args), [torch.nn.Parameter(torch.zeros(2))])
    params = deepspeed_peer.adamw_params(optimizer.defaults)
    assert params == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                      "weight_decay": optimizer.defaults["weight_decay"]}
    assert params["weight_decay"] == 0.01  # torch AdamW's default, which the deepcompile rows train with


def test_deepspeed_rows_need_their_own_process_and_deepcompiles_warmup():
    with pytest.raises(SystemExit):  # DeepSpeed and deepcompile must not share a process
        train_bench.parse_args(["--preset", "tiny", "--methods", "z3,ds-z3"])
    with pytest.raises(SystemExit):  # DeepSpeed DeepCompile re-plans at step 5
        train_bench.parse_args(["--preset", "tiny", "--isolate", "--methods", "ds-dc", "--warmup", "6"])
    alone = train_bench.parse_args(["--preset", "tiny", "--isolate", "--methods", "ds-z3", "--warmup", "1"])
    assert alone.methods == ["ds-z3"]
    # A row process of --isolate runs one row, without --isolate of its own.
    child = train_bench.parse_args(["--methods", "ds-dc", "--warmup", "7", "--child-json", "/tmp/row.json"])
    assert child.methods == ["ds-dc"]
    assert not set(train_bench.parse_args(["--methods", "all"]).methods) & set(deepspeed_peer.ROWS)


def test_peer_repeats_run_fsdp2_and_deepspeed_rows_twice_and_number_them():
    args = _args("--methods", "z3,fsdp2,ds-z3,ddp")
    assert peer_rows.repeat_peers(args, train_bench.REPEATED_PEERS) == ["z3", "fsdp2", "fsdp2", "ds-z3", "ds-z3", "ddp"]
    args.peer_repeats = 3
    assert peer_rows.repeat_peers(args, train_bench.REPEATED_PEERS).count("fsdp2") == 3
    args.child_json = "/tmp/row.json"  # a row process runs its row once
    assert peer_rows.repeat_peers(args, train_bench.REPEATED_PEERS) == ["z3", "fsdp2", "ds-z3", "ddp"]
    assert train_bench.parse_args(["--preset", "7b"]).peer_repeats == 1  # the 7B phases keep their time
    Row = train_bench.Row
    rows = [Row("deepcompile ZeRO-3", step_ms=70.0), Row(train_bench.FSDP2_NAME, step_ms=90.0, compile_s=5.0),
            Row(train_bench.FSDP2_NAME, status="OOM", note="CUDA out of memory")]
    peer_rows.number_repeats(rows)
    assert [r.repeat for r in rows] == [None, 1, 2]
    table = train_bench.text_table(rows)
    assert "FSDP2 + compile (run 1)" in table and "FSDP2 + compile (run 2)" in table
    assert "deepcompile ZeRO-3 (run" not in table


def test_row_processes_are_not_given_the_parents_nproc():
    # torchrun's parser refuses --nproc even after the script (an ambiguous prefix of --nproc-per-node).
    argv = ["--isolate", "--nproc", "2", "--methods", "ds-z3", "--nproc=2", "--steps", "3"]
    assert peer_rows.row_argv(argv) == ["--isolate", "--methods", "ds-z3", "--steps", "3"]
    cmd = __import__("row_process").child_command(peer_rows.row_argv(argv), "ds-z3", 2, "/tmp/row.json")
    assert "--nproc" not in cmd and cmd[cmd.index("--nproc-per-node") + 1] == "2"


def test_a_run_without_deepspeed_gets_a_row_saying_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ctx = types.SimpleNamespace(is_cuda=False)
    with pytest.raises(train_bench.Unavailable, match="^DeepSpeed not installed.*fetch_deepspeed_wheels"):
        deepspeed_peer.runner(ctx, "ds-z3")
