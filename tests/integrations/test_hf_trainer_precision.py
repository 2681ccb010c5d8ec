"""What the Trainer path computes in, and whether it is compiled (issue 37, items 1-3).

Under Trainer, deepcompile once trained in fp32 where the config said bf16: a model built inside
the served ``zero.Init`` (``from_config`` / ``from_pretrained`` after ``TrainingArguments``) was
materialised in the dtype it was built in, after the engine had cast the (meta) parameters to
bf16. The earlier Trainer tests never saw it: they ran fp32 (no ``bf16=True``) and built the
model plainly, and they checked what training returns (losses, weights), not what it computed in.
These runs use ``bf16=True`` on two gloo ranks, through the probe
(tests/_harness/hf_trainer_probe.py), which records the dtypes of every linear of the compiled
graphs, of the ``nn.Linear`` calls that ran eagerly, of what ZeRO-3's gathers return, of the
master shards and of the gradient partitions the reductions fill, and how the engine was compiled.
"""

from __future__ import annotations

import os

import pytest

from _harness import hf_launch

WORLD = 2
pytestmark = pytest.mark.world_size(WORLD)  # launched at WORLD ranks: ws2 in every test id (conftest.py)

EXAMPLE_ARGS = ["--deepspeed", os.path.join(hf_launch.EXAMPLES, "ds_config_zero3.json"), "--bf16",
                "--rows", "16", "--micro-batch", "2", "--accumulation", "1", "--max-steps", "2"]
BF16 = ["torch.bfloat16"] * 3


def _probe_run(tmp_path, name, extra):
    hf_launch.torchrun(hf_launch.TRAINER_PROBE, ["--probe-out", str(tmp_path / name), "--", *EXAMPLE_ARGS, *extra,
                                                 "--output-dir", str(tmp_path / f"{name}_out"),
                                                 "--out", str(tmp_path / f"{name}.json")], nproc=WORLD)
    probes = [hf_launch.read_json(f"{tmp_path / name}.rank{r}.json") for r in range(WORLD)]
    return probes, hf_launch.read_json(tmp_path / f"{name}.json")


def _assert_trained(result):
    losses = [e["loss"] for e in result["log_history"] if "loss" in e and "step" in e]
    assert len(losses) == 2 and all(l == l and l < 10 for l in losses), losses  # finite, ~ln(vocab)


def _assert_zero3_state(probe):
    # Gathers hand the graphs bf16 parameters; the masters stay fp32; gradients are reduced into
    # fp32 partitions (communication_data_type's default, docs/config.md).
    assert probe["precision"]["gather"] == ["torch.bfloat16"], probe["precision"]
    assert probe["precision"]["masters"] == ["torch.float32"], probe["precision"]
    assert probe["precision"]["grad_partitions"] == ["torch.float32"], probe["precision"]


def test_trainer_bf16_from_config_is_compiled_once_and_computes_in_bf16(tmp_path):
    """from_config inside the served zero.Init, TrainingArguments(bf16=True, torch_compile=True):
    the engine compiled itself at initialize, accelerate's engine.compile with the same backend
    did not compile again, every linear of the compiled graphs is bf16 and none ran eagerly."""
    probes, result = _probe_run(tmp_path, "compiled",
                                ["--from-config", "--torch-compile", "--compile-backend", "eager"])
    _assert_trained(result)
    for probe in probes:
        assert probe["compiled_at_initialize"] is True
        assert probe["compile_calls"] == 0, "accelerate's engine.compile() compiled a second time"
        assert probe["compiled"] == "compiled (eager, whole model)"
        linears = probe["compiled_linears"]
        assert linears and all(d == BF16 for d in linears), linears
        assert "eager_linears" not in probe, probe.get("eager_linears")
        _assert_zero3_state(probe)
        # Trainer filled reduce_bucket_size with hidden_size**2 (32**2 here) and the prefetch bucket
        # with 0.9 * hidden_size**2; the served initialize resolved both "auto"s as deepcompile
        # does: one decoder layer's elements.
        assert probe["given_reduce_bucket_size"] == 32 * 32
        assert probe["given_stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
        assert probe["reduce_bucket_size"] == probe["block_numel"] > 32 * 32, probe
        assert probe["stage3_prefetch_bucket_size"] == probe["block_numel"], probe
    summary = probes[0]["summary"]
    assert summary.startswith("deepcompile engine: ZeRO-3 over 2 ranks; compute in bfloat16, fp32 master "
                              "weights"), summary
    assert "gradients reduced in float32" in summary and "compiled (eager, whole model)" in summary, summary
    assert "prefetch + selective_gather from step 5" in summary, summary


def test_trainer_bf16_from_pretrained_uncompiled_computes_in_bf16(tmp_path):
    """from_pretrained inside the served zero.Init, compile.auto_compile false and no
    torch_compile: nothing is compiled, every nn.Linear runs eagerly with bf16 weights and
    inputs, and the summary says the run is uncompiled."""
    tiny = hf_launch.examples_module("hf_tiny")
    tiny.build_model(seed=0).save_pretrained(tmp_path / "pretrained")
    probes, result = _probe_run(tmp_path, "eager", ["--model-path", str(tmp_path / "pretrained"),
                                                    "--no-auto-compile"])
    _assert_trained(result)
    for probe in probes:
        assert probe["compiled_at_initialize"] is False and probe["compiled"] is False
        assert probe["compile_calls"] == 0
        assert "compiled_linears" not in probe
        assert probe["eager_linears"] == [BF16], probe["eager_linears"]
        _assert_zero3_state(probe)
    assert "uncompiled (eager ZeRO hooks; compile.auto_compile is false)" in probes[0]["summary"]
