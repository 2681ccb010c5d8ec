"""The ``deepcompile`` command (deepcompile/cli/), run as ``python -m deepcompile`` in subprocesses.

* ``export``: checkpoints saved by real gloo runs at world sizes 2 and 3, ZeRO-1 and ZeRO-3 (a
  model with a tied parameter and a persistent buffer), are exported offline in a fresh process
  with no process group; every exported tensor equals ``engine.full_state_dict()`` of the engine
  that saved it, and the names left out are exactly the tied aliases. Exports of a tiny
  transformers Llama and Qwen2-MoE (whose experts transformers stores per expert) load with
  ``from_pretrained`` and have the trained values;
* ``check``: a valid config prints its resolved batch sizes and "auto" values (naming those that
  need the model, resolving them with ``--model``); a bad one prints every problem, exit code 1;
* ``env``: the report names torch, NCCL, whether deepcompile's NCCL path was compiled, and GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from _harness.multiproc import run_distributed
from _harness.tied_lm import TiedBufferedLM
from _harness.parity_cases import GLOBAL_BATCH, batch, make_optimizer, tiny_llama, tiny_qwen2_moe
from _harness.paths import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "ds_configs")


def _cli(*args, check=True):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # offline: no GPU
    result = subprocess.run([sys.executable, "-m", "deepcompile", *args], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=600)
    if check:
        assert result.returncode == 0, f"deepcompile {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _save_body(ctx, root, stages):
    import deepcompile

    n = GLOBAL_BATCH // ctx.world_size
    for stage in stages:
        torch.manual_seed(7)
        model = TiedBufferedLM()
        cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
        tokens, _ = batch("tied", 0)
        part = tokens[ctx.rank * n:(ctx.rank + 1) * n]
        engine.backward(engine(part, part))
        engine.step()
        where = os.path.join(root, f"ws{ctx.world_size}_stage{stage}")
        engine.save_checkpoint(where)
        state = engine.full_state_dict()
        if ctx.rank == 0:
            torch.save(state, os.path.join(where, "expected.pt"))
        engine.destroy()


def _save_hf_model_body(ctx, root, which):
    import deepcompile

    torch.manual_seed(3)
    model = {"llama": tiny_llama, "qwen2_moe": tiny_qwen2_moe}[which]()
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": 3}})
    tokens, _ = batch("llama", 0)
    n = GLOBAL_BATCH // ctx.world_size
    part = tokens[ctx.rank * n:(ctx.rank + 1) * n]
    engine.backward(engine(input_ids=part, labels=part, use_cache=False).loss)
    engine.step()
    engine.save_checkpoint(root, tag="trained")
    state = engine.full_state_dict()
    if ctx.rank == 0:
        torch.save(state, os.path.join(root, "expected.pt"))
    engine.destroy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cli_checkpoints"))
    for world_size in (2, 3):
        run_distributed(_save_body, world_size, args=(root, (1, 3)), timeout=300)
    return root


def _exported(folder):
    from safetensors.torch import load_file

    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(folder, f)))
    return out


@pytest.mark.parametrize("saved", ["ws2_stage1", "ws2_stage3", "ws3_stage1", "ws3_stage3"],
                         ids=lambda s: s.replace("_", "-"))  # ws<n> in the id: the saving world size
def test_export_offline_equals_the_full_state_dict(checkpoints, saved, tmp_path):
    ckpt = os.path.join(checkpoints, saved)
    out = str(tmp_path / "export")
    result = _cli("export", ckpt, out)
    assert "wrote 6 tensors" in result.stdout, result.stdout
    expected = torch.load(os.path.join(ckpt, "expected.pt"))
    got = _exported(out)
    assert set(got) <= set(expected), sorted(set(got) - set(expected))
    for name, value in got.items():
        assert value.dtype == expected[name].dtype, name
        assert torch.equal(value, expected[name]), f"{name} differs from the engine's full_state_dict"
    # Left out: only the tied alias, stored once under the checkpoint's name.
    assert set(expected) - set(got) == {"head.weight"}
    assert torch.equal(got["embed.weight"], expected["head.weight"])


def test_export_dtype_and_refusals(checkpoints, tmp_path):
    ckpt = os.path.join(checkpoints, "ws2_stage3")
    out = str(tmp_path / "bf16")
    _cli("export", ckpt, out, "--dtype", "bf16", "--max-shard-size", "300B")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")), os.listdir(out)
    got, expected = _exported(out), torch.load(os.path.join(ckpt, "expected.pt"))
    assert got["mix.weight"].dtype == torch.bfloat16 and torch.equal(got["mix.weight"], expected["mix.weight"].bfloat16())
    assert got["scale"].dtype == torch.float32  # buffers keep their dtype
    again = _cli("export", ckpt, out, check=False)
    assert again.returncode != 0 and "not empty: pass --overwrite" in again.stderr + again.stdout
    missing = _cli("export", str(tmp_path / "nowhere"), str(tmp_path / "x"), check=False)
    assert missing.returncode == 1 and "does not exist" in missing.stderr


@pytest.mark.world_size(2)
@pytest.mark.parametrize("which", ["llama", "qwen2_moe"])
def test_export_of_a_transformers_model_loads_with_from_pretrained(which, tmp_path):
    """Qwen2-MoE: transformers computes with fused expert tensors but stores them per expert; the
    export writes them as transformers stores them."""
    from transformers import AutoModelForCausalLM

    root = str(tmp_path / "ckpt")
    run_distributed(_save_hf_model_body, 2, args=(root, which), timeout=300)
    assert os.path.isfile(os.path.join(root, "trained", "config.json")), "save_checkpoint wrote no config.json"
    out = str(tmp_path / "hf")
    result = _cli("export", root, out, "--tag", "trained")
    assert "config.json" in result.stdout
    if which == "qwen2_moe":
        names = set(_exported(out))
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in names, sorted(names)
        assert not any("gate_up_proj" in n for n in names), sorted(names)
    model = AutoModelForCausalLM.from_pretrained(out)
    expected = torch.load(os.path.join(root, "expected.pt"))
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


def test_check_prints_the_resolved_auto_values(tmp_path):
    result = _cli("check", os.path.join(FIXTURES, "dschat_train_zero3_bf16.json"), "--world-size", "2")
    assert "OK at world size 2" in result.stdout, result.stdout
    assert "  train_batch_size: 32" in result.stdout

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                                  "bf16": {"enabled": "auto"},
                                  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}))
    plain = _cli("check", str(config), "--world-size", "4").stdout
    assert "  train_batch_size: 16" in plain
    assert "  bf16.enabled: depends on the model" in plain
    assert "  zero_optimization.reduce_bucket_size: depends on the model" in plain
    tiny_llama().config.save_pretrained(str(tmp_path / "llama"))
    with_model = _cli("check", str(config), "--world-size", "4", "--model", str(tmp_path / "llama")).stdout
    assert "  bf16.enabled: false" in with_model
    # One decoder layer's elements (config/auto.py), here more than hidden_size**2 = 576.
    layer = sum(p.numel() for p in tiny_llama().model.layers[0].parameters())
    assert layer > 24 * 24 and f"  zero_optimization.reduce_bucket_size: {layer}" in with_model


def test_check_reports_every_problem(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 5, "bogus": 1}}))
    result = _cli("check", str(config), check=False)
    assert result.returncode == 1
    assert "2 problem(s)" in result.stdout
    assert "zero_optimization.bogus" in result.stdout and "zero_optimization.stage must be 1, 2 or 3" in result.stdout
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4,
                                 "zero_optimization": {"stage": 1}}))
    result = _cli("check", str(sizes), "--world-size", "2", check=False)
    assert result.returncode == 1 and "train_batch_size (6) must be divisible" in result.stdout, result.stdout
    # Refused for fp32 models only: not a problem of the config alone, so listed without failing.
    some = tmp_path / "some.json"
    some.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": "auto"},
                                "communication_data_type": "bf16", "zero_optimization": {"stage": 2}}))
    out = _cli("check", str(some), "--world-size", "2").stdout
    assert '"auto" values (for a bf16 model' in out, out
    assert "refused for some models" in out and "communication_data_type" in out, out


def test_env_report():
    out = _cli("env").stdout
    for row in ("torch ", "NCCL (torch)", "deepcompile NCCL path compiled", "C++ compiler", "CUDA available"):
        assert row in out, (row, out)
    assert "GPUs" in out or "GPU 0" in out
    # The Hugging Face stack, each with its installed version (or "not installed").
    import importlib.metadata

    for package in ("transformers", "accelerate", "peft", "trl"):
        line = next((line for line in out.splitlines() if line.split()[:1] == [package]), None)
        assert line is not None, (package, out)
        assert line.split()[1] == importlib.metadata.version(package), line
    line = next(line for line in out.splitlines() if line.startswith("deepcompile NCCL path compiled"))
    assert line.split()[4] in ("yes", "no"), line
