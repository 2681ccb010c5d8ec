"""A LLaVA/FastChat/Qwen-style LoRA fine-tuning script's end-of-training save at ZeRO-2 and ZeRO-3
(issue 41), on deepcompile served as ``deepspeed``.

tests/_harness/hf_lora_save_worker.py trains PEFT LoRA adapters (q_proj, v_proj) and a trainable
lm_head (standing for LLaVA's projector) on a tiny Llama with transformers'
Trainer on two gloo ranks, then saves as those scripts do: ``maybe_zero_3`` on every parameter to
save (``hasattr(param, "ds_id")`` -> read ``ds_status``, gather with
``deepspeed.zero.GatheredParameters``), ``save_pretrained(state_dict=lora_state)`` and
non_lora_trainables.bin on rank 0.

Checked: the saved adapter loads back with ``PeftModel.from_pretrained`` on a fresh base and its
LoRA weights (and, loaded from non_lora_trainables.bin, the lm_head) equal what the engine holds
after training, bitwise; lora_B moved away from its zero init; nothing saved is NaN (a ZeRO-3
placeholder read outside a gather is); the frozen base is untouched; ``ds_id`` exists at ZeRO-3
only (DeepSpeed's contract, which these scripts branch on: issue 41 met a ``ds_id`` at ZeRO-2
without ``ds_status``); and the trained weights match the same training in one process with plain
PyTorch on the same global batches.

The pytest process never serves deepcompile as ``deepspeed`` nor imports the worker (transformers
may be imported here already); the shared model and data come from _harness/lora_save_case.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from _harness import hf_launch, lora_save_case as case

pytestmark = pytest.mark.world_size(case.WORLD)  # launched at case.WORLD ranks: in every test id (conftest.py)

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_harness",
                      "hf_lora_save_worker.py")
# LLaVA's scripts/zero2.json, in substance: ZeRO-2 with "auto" sizes.
ZERO2 = {"bf16": {"enabled": "auto"},
         "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                               "sub_group_size": 1e9, "reduce_bucket_size": "auto"},
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
         "train_micro_batch_size_per_gpu": "auto"}
# fp32 on CPU; the runs differ in summation order (two half-batch gradients averaged against one
# whole-batch gradient, fused AdamW against the engine's update): ~1e-7 relative on losses; the
# trained weights differed by at most 6e-8 here (2026-11-28, both stages), and AdamW's normalised
# step can turn such gradient differences into ~1e-6 on near-zero-gradient elements (see
# test_hf_trainer.py). One step at lr 1e-2 moves a weight by ~1e-2, so a missed, doubled or
# unsaved update is far outside these.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)


def _config(stage: int, path) -> str:
    if stage == 3:
        with open(os.path.join(hf_launch.EXAMPLES, "ds_config_zero3.json")) as f:
            config = json.load(f)
    else:
        config = json.loads(json.dumps(ZERO2))
    # These runs test the save, not code generation: the eager backend (seconds, not Inductor's
    # ~30 s per launch on 2 cores).
    config["compile"] = {"backend": "eager"}
    with open(path, "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.fixture(scope="module")
def reference():
    model, losses = case.reference()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses}


def _no_nan(state, what):
    for name, t in state.items():
        assert torch.isfinite(t).all(), f"{what}: {name} has non-finite values"


@pytest.mark.parametrize("stage", [2, 3])
def test_llava_style_lora_save(stage, tmp_path, reference):
    pytest.importorskip("peft")
    from peft import PeftModel
    from safetensors.torch import load_file

    out_dir, out_json = tmp_path / "o", tmp_path / "out.json"
    hf_launch.torchrun(WORKER, ["--deepspeed", _config(stage, tmp_path / "ds.json"), "--output-dir", str(out_dir),
                                "--out", str(out_json)], nproc=case.WORLD, env={"HF_HUB_OFFLINE": "1"})
    out = hf_launch.read_json(out_json)
    assert out["engine"] == "deepcompile.integrations.deepspeed_api.engine", out["engine"]
    assert out["stage"] == stage and out["world_size"] == case.WORLD

    # ds_id exactly where DeepSpeed sets it: on every parameter ZeRO-3 partitioned, never at ZeRO-2
    # (where the scripts then read .data directly, which is the full value there).
    probe = out["probe"]
    trainable = {n for n, p in probe.items() if p["requires_grad"]}
    assert any("lora_B" in n for n in trainable) and "base_model.model.lm_head.weight" in trainable, trainable
    if stage == 3:
        assert all(p["ds_id"] for p in probe.values()), [n for n, p in probe.items() if not p["ds_id"]]
        # Whatever a parameter reported as NOT_AVAILABLE really needed the gather: its .data
        # outside one is not the full finite value (so a save that skipped the gather would fail
        # the checks below), and the script warned about exactly those.
        partitioned = sorted(n for n, p in probe.items() if p["ds_status"] == "NOT_AVAILABLE")
        assert not any(probe[n]["full_finite_outside"] for n in partitioned), partitioned
        assert any(n in trainable for n in partitioned), partitioned
        warned = set(out["not_available_warned"])
        assert warned == {n for n in partitioned if n in trainable}, (warned, partitioned)
    else:
        assert not any(p["ds_id"] for p in probe.values()), [n for n, p in probe.items() if p["ds_id"]]
        assert all(p["full_finite_outside"] for p in probe.values())
        assert out["not_available_warned"] == []

    # What the engine holds after training, two ways, agreeing bitwise and NaN-free.
    gathered = torch.load(out_dir / "engine_gathered.pt")
    consolidated = torch.load(out_dir / "engine_consolidated.pt")
    _no_nan(gathered, "whole-model GatheredParameters")
    _no_nan(consolidated, "engine state dict")
    assert gathered.keys() <= consolidated.keys()
    for name, value in gathered.items():
        assert torch.equal(value, consolidated[name]), name

    # The script's saved files.
    adapter_dir = out_dir / "adapter"
    assert (adapter_dir / "config.json").is_file() and (adapter_dir / "adapter_config.json").is_file()
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    _no_nan(saved, "adapter_model.safetensors")
    lora_names = sorted(n for n in gathered if "lora_" in n)
    assert len(saved) == len(lora_names) == 2 * 2 * len(case.LORA_TARGETS)  # A and B, 2 layers
    non_lora = torch.load(adapter_dir / case.NON_LORA_FILE)
    _no_nan(non_lora, case.NON_LORA_FILE)
    assert sorted(non_lora) == sorted(trainable - set(lora_names)) and non_lora, sorted(non_lora)
    for name, value in non_lora.items():
        assert value.shape == gathered[name].shape and torch.equal(value, gathered[name]), name
    # Every rank gathered the same values (the gathers are collective).
    ranks = [torch.load(out_dir / f"lora_rank{r}.pt") for r in range(case.WORLD)]
    assert sorted(ranks[0]) == lora_names
    for r in range(1, case.WORLD):
        assert all(torch.equal(ranks[0][n], ranks[r][n]) for n in lora_names), r

    # Loaded back as a user would: a fresh identical base, the adapter, then the non-LoRA
    # trainables into the PEFT model (LLaVA's load_state_dict(strict=False)).
    loaded = PeftModel.from_pretrained(case.build_base(), str(adapter_dir))
    result = loaded.load_state_dict(non_lora, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    got = dict(loaded.named_parameters())
    fresh = dict(case.build_peft_model().named_parameters())
    for name in lora_names:
        assert got[name].shape == gathered[name].shape and torch.equal(got[name].detach(), gathered[name]), name
        if "lora_B" in name:
            assert fresh[name].abs().max() == 0 and gathered[name].abs().max() > 1e-4, name  # trained, saved
        else:
            assert not torch.equal(gathered[name], fresh[name]), name  # lora_A trained too
    for name in non_lora:
        assert torch.equal(got[name].detach(), non_lora[name]), name
        assert not torch.equal(non_lora[name], fresh[name]), name
    for name, value in gathered.items():  # the frozen base is the fresh one, bitwise
        if name not in trainable:
            assert torch.equal(value, fresh[name]), name
            assert torch.equal(got[name].detach(), value), name

    # The same training in one process: losses per step and the trained weights.
    losses = [e["loss"] for e in out["log_history"] if "loss" in e and "step" in e]
    assert len(losses) == case.STEPS, out["log_history"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), **LOSS_TOL)
    assert losses[-1] < losses[0]
    for name in trainable:
        torch.testing.assert_close(gathered[name], reference["params"][name], **WEIGHT_TOL,
                                   msg=lambda m: f"{name}: {m}")
