"""transformers' Trainer with DeepSpeed ZeRO-3 running on deepcompile (serve_as_deepspeed()).

examples/hf_trainer.py on two gloo ranks with examples/ds_config_zero3.json ("auto" batch sizes,
accumulation, clipping and buckets), against the same script without DeepSpeed in one process on
the same global batches: the logged loss, grad norm and learning rate of every step, the
evaluation loss, and the weights save_model() wrote, loaded back with from_pretrained. Then a
run resumed from its save_steps checkpoint continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from _harness import hf_launch

EXAMPLE = os.path.join(hf_launch.EXAMPLES, "hf_trainer.py")
DS_CONFIG = os.path.join(hf_launch.EXAMPLES, "ds_config_zero3.json")
ROWS, MICRO, ACCUM, WORLD = 48, 2, 2, 2
pytestmark = pytest.mark.world_size(WORLD)  # launched at WORLD ranks: ws2 in every test id (conftest.py)
STEPS = ROWS // (MICRO * ACCUM * WORLD)

# fp32 on CPU; the runs differ only in summation order (two half-batch gradients averaged by the
# reduce-scatter against one whole-batch gradient): measured ~1e-7 relative on losses and norms
# after 6 AdamW steps. A wrong loss scaling, averaging or schedule step is off by >1e-3.
TOL = dict(rtol=1e-5, atol=1e-6)
# Trained weights: AdamW's normalised step turns those ~1e-7 gradient differences into up to
# ~1e-6 on elements whose gradient is near zero (seen on a Qwen2-MoE bias). 1e-5 is a thousandth
# of one step at lr 1e-2; a missed or doubled update moves weights by ~1e-2.
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)
# The served engine compiles itself (compile.auto_compile); these runs test what Trainer does with
# it, not code generation, so they compile with the eager backend (the traced graph with
# deepcompile's passes, run as is: seconds instead of Inductor's ~30 s per launch on 2 cores). The
# PEFT LoRA run keeps Inductor: it met the release-after-recomputed-read bug there (9aac4f0).
FAST_COMPILE = ["--compile-backend", "eager"]


def _common(out, output_dir):
    return ["--rows", str(ROWS), "--accumulation", str(ACCUM), "--output-dir", str(output_dir), "--out", str(out)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The DeepSpeed run on 2 ranks (checkpointing every 3 steps) and the single-process reference."""
    base = tmp_path_factory.mktemp("hf_trainer")
    ds_dir, ref_dir = base / "ds", base / "ref"
    ds = hf_launch.torchrun(EXAMPLE, ["--deepspeed", DS_CONFIG, *FAST_COMPILE, "--micro-batch", str(MICRO),
                                      "--save-steps", "3",
                                      *_common(base / "ds.json", ds_dir)], nproc=WORLD)
    hf_launch.run_checked([sys.executable, EXAMPLE, "--micro-batch", str(MICRO * WORLD),
                           *_common(base / "ref.json", ref_dir)], env=hf_launch.launch_env())
    return {"base": base, "ds_dir": ds_dir, "ref_dir": ref_dir, "ds_stdout": ds.stdout,
            "ds": hf_launch.read_json(base / "ds.json"), "ref": hf_launch.read_json(base / "ref.json")}


def _per_step(result, key):
    return [entry[key] for entry in result["log_history"] if key in entry and "step" in entry]


def test_trainer_zero3_matches_single_process(runs):
    ds, ref = runs["ds"], runs["ref"]
    assert ds["engine"] == "deepcompile.integrations.deepspeed_api.engine" and ds["world_size"] == WORLD
    assert ref["world_size"] == 1
    for key in ("loss", "grad_norm", "learning_rate"):
        got, want = _per_step(ds, key), _per_step(ref, key)
        assert len(got) == len(want) == STEPS, key
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m: f"{key}: {m}")
    assert _per_step(ds, "loss")[-1] < _per_step(ds, "loss")[0] - 0.3  # it learned
    torch.testing.assert_close(ds["eval"]["eval_loss"], ref["eval"]["eval_loss"], **TOL)


def test_trainer_save_model_loads_with_from_pretrained(runs):
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(runs["ds_dir"] / "model").state_dict()
    want = AutoModelForCausalLM.from_pretrained(runs["ref_dir"] / "model").state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_trainer_resume_from_checkpoint_continues_exactly(runs):
    """Resume from checkpoint-3 of the run above (its later checkpoint removed): steps 4..6 log
    the same loss, grad norm and learning rate as the uninterrupted run, and the end state
    evaluates the same."""
    resumed_dir = runs["base"] / "resumed"
    os.makedirs(resumed_dir)
    shutil.copytree(runs["ds_dir"] / "checkpoint-3", resumed_dir / "checkpoint-3")
    proc = hf_launch.torchrun(EXAMPLE, ["--deepspeed", DS_CONFIG, *FAST_COMPILE, "--micro-batch", str(MICRO),
                                        "--save-steps", "3",
                                        "--resume", *_common(runs["base"] / "resumed.json", resumed_dir)], nproc=WORLD)
    resumed, full = hf_launch.read_json(runs["base"] / "resumed.json"), runs["ds"]
    # Only steps 4..6 trained in this run (rank 0 prints one loss line per logged step).
    assert proc.stdout.count("'loss'") == STEPS - 3, proc.stdout[-3000:]
    for key in ("loss", "grad_norm", "learning_rate"):
        assert _per_step(resumed, key) == _per_step(full, key), key  # bitwise: same ranks, same work
    assert resumed["eval"]["eval_loss"] == full["eval"]["eval_loss"]


def _from_pretrained_runs(base, name, model_path, extra=()):
    """examples/hf_trainer.py --model-path on 2 ranks (through the probe, which records how each
    rank held the parameters when Trainer called deepspeed.initialize, and the buffers after it)
    and in one process without DeepSpeed, which builds the model fully from the same files."""
    args = ["--model-path", str(model_path), *extra]
    hf_launch.torchrun(hf_launch.TRAINER_PROBE, ["--probe-out", str(base / f"{name}_probe"), "--",
                                                 "--deepspeed", DS_CONFIG, *FAST_COMPILE,
                                                 "--micro-batch", str(MICRO), *args,
                                                 *_common(base / f"{name}_ds.json", base / f"{name}_ds")], nproc=WORLD)
    hf_launch.run_checked([sys.executable, EXAMPLE, "--micro-batch", str(MICRO * WORLD), *args,
                           *_common(base / f"{name}_ref.json", base / f"{name}_ref")], env=hf_launch.launch_env())
    probes = [hf_launch.read_json(f"{base / name}_probe.rank{r}.json") for r in range(WORLD)]
    return hf_launch.read_json(base / f"{name}_ds.json"), hf_launch.read_json(base / f"{name}_ref.json"), probes


def _assert_only_slices_held(probes):
    """Between from_pretrained (inside deepspeed.zero.Init) and deepspeed.initialize no rank held
    the model: every parameter was deferred, its .data owned one element (the placeholder), and
    each rank held exactly its ceil(numel / world) elements of the value."""
    for rank, probe in enumerate(probes):
        params = probe["at_initialize"]
        assert params, rank
        for name, p in params.items():
            assert p["deferred"] and p["data_bytes"] <= 8, (rank, name, p)
            assert p["held_elements"] == -(-p["numel"] // WORLD), (rank, name, p)


def test_trainer_from_pretrained_and_gradient_checkpointing_match_single_process(runs):
    """The model comes from from_pretrained after TrainingArguments: transformers builds it inside
    the served deepspeed.zero.Init (each rank keeps a slice of every parameter) and loads the
    files on rank 0 through zero.GatheredParameters(modifier_rank=0); Trainer turns on gradient
    checkpointing. The run matches the same script without DeepSpeed in one process (which
    builds the whole model from the same files), no rank held the model before initialize, and
    the rotary inv_freq (a buffer the files do not hold) is transformers' own, bitwise."""
    from transformers import AutoModelForCausalLM

    base, pretrained = runs["base"], runs["ref_dir"] / "model"
    ds, ref, probes = _from_pretrained_runs(base, "gc", pretrained, ["--gradient-checkpointing"])
    assert _per_step(ds, "loss")[0] < _per_step(runs["ds"], "loss")[0] - 0.3  # started from the trained weights
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(_per_step(ds, key)), torch.tensor(_per_step(ref, key)), **TOL,
                                   msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(ds["eval"]["eval_loss"], ref["eval"]["eval_loss"], **TOL)
    _assert_only_slices_held(probes)
    own = dict(AutoModelForCausalLM.from_pretrained(pretrained).named_buffers())
    assert "model.rotary_emb.inv_freq" in own
    for probe in probes:
        assert probe["buffers"].keys() == own.keys()
        for name, value in own.items():
            assert torch.equal(torch.tensor(probe["buffers"][name], dtype=value.dtype), value), name


def test_trainer_qwen2_moe_from_pretrained_loads_slices(tmp_path):
    """Qwen2-MoE from_pretrained under ZeRO-3: transformers converts the per-expert tensors of the
    files into its fused expert parameters while it loads on rank 0; the served zero.Init keeps
    each rank's slice of the converted values. Losses and grad norms match the run without
    DeepSpeed from the same files, and no rank held the model before initialize."""
    tiny = hf_launch.examples_module("hf_tiny")
    folder = tmp_path / "qwen2_moe"
    tiny.build_model(seed=1, arch="qwen2_moe").save_pretrained(folder)
    ds, ref, probes = _from_pretrained_runs(tmp_path, "moe_fp", folder)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(_per_step(ds, key)), torch.tensor(_per_step(ref, key)), **TOL,
                                   msg=lambda m: f"{key}: {m}")
    _assert_only_slices_held(probes)
    assert any(".experts." in name for name in probes[0]["at_initialize"])


def test_trainer_config_with_optimizer_and_scheduler_sections(runs):
    """transformers' documented ZeRO-3 config: "auto" optimizer (AdamW) and scheduler
    (WarmupDecayLR) sections, fp16/bf16 "auto". deepcompile builds both from the sections Trainer
    filled (lr, betas, eps, weight decay, warmup and total steps): the logged learning rates are
    DeepSpeed's WarmupDecayLR (log warmup over warmup_steps=2, then linear to 0 at step 6), and
    the first two steps (before the schedules differ) match the reference's losses."""
    base = runs["base"]
    config = os.path.join(hf_launch.EXAMPLES, "ds_config_zero3_hf.json")
    hf_launch.torchrun(EXAMPLE, ["--deepspeed", config, *FAST_COMPILE, "--micro-batch", str(MICRO),
                                 *_common(base / "sections.json", base / "sections")], nproc=WORLD)
    got = hf_launch.read_json(base / "sections.json")
    assert got["engine"] == "deepcompile.integrations.deepspeed_api.engine"
    lr, warmup, total = 1e-2, 2, STEPS
    import math

    def warmup_decay(i):  # the LR after i scheduler steps, as DeepSpeed's WarmupDecayLR computes it
        if i < warmup:
            return lr * math.log(i + 1) / math.log(warmup)
        return lr * max(0.0, (total - i) / (total - warmup))

    torch.testing.assert_close(torch.tensor(_per_step(got, "learning_rate")),
                               torch.tensor([warmup_decay(i) for i in range(STEPS)]), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(torch.tensor(_per_step(got, "loss")[:2]),
                               torch.tensor(_per_step(runs["ref"], "loss")[:2]), **TOL)
    assert _per_step(got, "loss")[-1] < _per_step(got, "loss")[0] - 0.3


def test_trainer_peft_lora_matches_single_process_and_resumes(runs):
    """PEFT LoRA adapters on the ZeRO-3 model (frozen base parameters): the logged loss and grad
    norm match the run without DeepSpeed, save_model writes the same adapter weights, and a run
    resumed from its save_steps checkpoint (Trainer saves PEFT checkpoints with
    exclude_frozen_parameters) continues exactly."""
    from safetensors.torch import load_file

    base = runs["base"]
    ds_args = ["--deepspeed", DS_CONFIG, "--micro-batch", str(MICRO), "--lora", "--save-steps", "3"]
    hf_launch.torchrun(EXAMPLE, [*ds_args, *_common(base / "lora_ds.json", base / "lora_ds")], nproc=WORLD)
    hf_launch.run_checked([sys.executable, EXAMPLE, "--micro-batch", str(MICRO * WORLD), "--lora",
                           *_common(base / "lora_ref.json", base / "lora_ref")], env=hf_launch.launch_env())
    ds, ref = hf_launch.read_json(base / "lora_ds.json"), hf_launch.read_json(base / "lora_ref.json")
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(_per_step(ds, key)), torch.tensor(_per_step(ref, key)), **TOL,
                                   msg=lambda m: f"{key}: {m}")
    got = load_file(base / "lora_ds" / "model" / "adapter_model.safetensors")
    want = load_file(base / "lora_ref" / "model" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all("lora_" in k for k in got)  # only the adapters are saved
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")

    resumed_dir = base / "lora_resumed"
    os.makedirs(resumed_dir)
    shutil.copytree(base / "lora_ds" / "checkpoint-3", resumed_dir / "checkpoint-3")
    hf_launch.torchrun(EXAMPLE, [*ds_args, "--resume", *_common(base / "lora_resumed.json", resumed_dir)],
                       nproc=WORLD)
    resumed = hf_launch.read_json(base / "lora_resumed.json")
    for key in ("loss", "grad_norm", "learning_rate"):
        assert _per_step(resumed, key) == _per_step(ds, key), key


def test_trainer_qwen2_moe_matches_single_process(runs):
    """A tiny Qwen2-MoE (routed experts, transformers' fused expert parameters): losses and grad
    norms match the run without DeepSpeed, and save_model writes the per-expert tensors
    save_pretrained writes, which from_pretrained loads to the reference's weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = runs["base"]
    hf_launch.torchrun(EXAMPLE, ["--deepspeed", DS_CONFIG, *FAST_COMPILE, "--arch", "qwen2_moe",
                                 "--micro-batch", str(MICRO),
                                 *_common(base / "moe_ds.json", base / "moe_ds")], nproc=WORLD)
    hf_launch.run_checked([sys.executable, EXAMPLE, "--arch", "qwen2_moe", "--micro-batch", str(MICRO * WORLD),
                           *_common(base / "moe_ref.json", base / "moe_ref")], env=hf_launch.launch_env())
    ds, ref = hf_launch.read_json(base / "moe_ds.json"), hf_launch.read_json(base / "moe_ref.json")
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(_per_step(ds, key)), torch.tensor(_per_step(ref, key)), **TOL,
                                   msg=lambda m: f"{key}: {m}")
    files = [safe_open(base / run / "model" / "model.safetensors", "pt") for run in ("moe_ds", "moe_ref")]
    assert sorted(files[0].keys()) == sorted(files[1].keys())
    assert any(".experts.0." in k for k in files[0].keys())
    got = AutoModelForCausalLM.from_pretrained(base / "moe_ds" / "model").state_dict()
    want = AutoModelForCausalLM.from_pretrained(base / "moe_ref" / "model").state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **WEIGHT_TOL, msg=lambda m: f"{name}: {m}")


HYBRID_WORLD, HYBRID_SHARD = 4, 2


def test_trainer_hybrid_sharding_matches_single_process(runs):
    """zero_optimization.mics_shard_size in the Trainer's DeepSpeed config (examples/hf_trainer.py
    --mics-shard-size) on 4 ranks as 2 shard groups of 2: the served deepspeed.initialize builds a
    hybrid engine (every optimizer step's bytes have a replica link carrying the gradient
    partitions' all-reduce). With one row per rank and micro-step the global batches are the
    2-rank run's, so the logged loss, grad norm and learning rate match the same single-process
    reference, within the same tolerance (the sum over 4 quarter-batches instead of 2 halves)."""
    base = runs["base"]
    micro = MICRO * WORLD // HYBRID_WORLD
    hf_launch.torchrun(hf_launch.TRAINER_PROBE, [
        "--probe-out", str(base / "hybrid_probe"), "--", "--deepspeed", DS_CONFIG, *FAST_COMPILE,
        "--mics-shard-size", str(HYBRID_SHARD), "--micro-batch", str(micro),
        *_common(base / "hybrid.json", base / "hybrid")], nproc=HYBRID_WORLD)
    got, ref = hf_launch.read_json(base / "hybrid.json"), runs["ref"]
    assert got["engine"] == "deepcompile.integrations.deepspeed_api.engine" and got["world_size"] == HYBRID_WORLD
    for rank in range(HYBRID_WORLD):
        probe = hf_launch.read_json(f"{base / 'hybrid_probe'}.rank{rank}.json")
        assert probe["topology"] == {"hybrid": True, "shard_size": HYBRID_SHARD,
                                     "replicas": HYBRID_WORLD // HYBRID_SHARD}, rank
        assert len(probe["scales"]) == STEPS, rank
        for step in probe["scales"]:
            links = step["comm_bytes"]
            assert set(links) == {"shard", "replica"}, (rank, links)
            assert links["shard"]["ranks"] == HYBRID_SHARD and links["replica"]["ranks"] == HYBRID_WORLD // HYBRID_SHARD
            assert links["replica"]["all_reduce"] > 0 and links["shard"]["reduce_scatter"] > 0, (rank, links)
    for key in ("loss", "grad_norm", "learning_rate"):
        got_values, want = _per_step(got, key), _per_step(ref, key)
        assert len(got_values) == len(want) == STEPS, key
        torch.testing.assert_close(torch.tensor(got_values), torch.tensor(want), **TOL, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(got["eval"]["eval_loss"], ref["eval"]["eval_loss"], **TOL)


def test_trainer_evaluate_without_training_is_zero_inference(tmp_path):
    """Trainer.evaluate() with no training first: Trainer initializes DeepSpeed without an
    optimizer (ZeRO inference); the evaluation loss is the untrained model's, computed here in
    one process."""
    hf_launch.torchrun(EXAMPLE, ["--deepspeed", DS_CONFIG, *FAST_COMPILE, "--micro-batch", str(MICRO), "--eval-only",
                                 *_common(tmp_path / "eval.json", tmp_path / "eval")], nproc=WORLD)
    got = hf_launch.read_json(tmp_path / "eval.json")
    assert got["engine"] == "deepcompile.integrations.deepspeed_api.frozen_zero3"  # partitioned, no runtime
    tiny = hf_launch.examples_module("hf_tiny")
    model, rows = tiny.build_model(seed=0).eval(), tiny.token_rows(8, seed=1)
    with torch.no_grad():
        want = model(input_ids=rows, labels=rows).loss.item()
    torch.testing.assert_close(got["eval"]["eval_loss"], want, **TOL)
