"""Every example runs with the command the README gives, on the CPU, at small sizes.

The examples are templates users copy; one that breaks silently sends a newcomer away at the
first command. Each runs here as ``torchrun --nproc-per-node 2 examples/<name>.py`` plus flags
that shrink it (fewer steps, the eager backend) and ``--cpu`` so that a GPU machine runs it the
same way. What each prints is what the README and the example's docstring promise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _harness.paths import ROOT

EXAMPLES = ROOT / "examples"
# The example scripts this file runs; test_every_example_script_is_run_by_a_test checks that
# each script under examples/ is run here or named by another test.
RUN_HERE = {"train_llama.py", "finetune.py", "ops_demo.py"}


def torchrun(script, *args: str, cwd: Path, nproc: int = 2, timeout: int = 600, **env_vars: str) -> str:
    """Runs an example (a name under examples/ or a path) as the README does; returns its output,
    failing the test with it on error."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_vars)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(EXAMPLES / script), *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} {' '.join(args)} exited with {done.returncode}:\n{output[-6000:]}"
    return output


@pytest.mark.world_size(2)  # torchrun --nproc-per-node 2
def test_train_llama_matches_single_process_training(tmp_path):
    out = torchrun("train_llama.py", "--steps", "2", "--backend", "eager", "--cpu", cwd=tmp_path)
    assert "2 ranks on cpu" in out
    assert "step   1  loss" in out
    assert "-> OK" in out


@pytest.mark.world_size(2)  # torchrun --nproc-per-node 2
def test_finetune_trains_checkpoints_resumes_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    small = ["--out", str(tmp_path / "run"), "--rows", "32", "--seq", "16", "--save-every", "2",
             "--backend", "eager", "--cpu"]
    first = torchrun("finetune.py", "--steps", "2", *small, cwd=tmp_path)
    assert "finetune: saved checkpoint" in first and "global_step2" in first
    assert "trained steps 0 -> 2" in first

    # The same command with more steps continues from the checkpoint instead of starting over.
    second = torchrun("finetune.py", "--steps", "3", *small, cwd=tmp_path)
    assert "resumed from" in second and "at step 2" in second
    assert "trained steps 2 -> 3" in second
    assert (tmp_path / "run" / "checkpoints" / "global_step3").is_dir()

    # save_hf wrote files from_pretrained loads, holding trained (changed) bf16 weights.
    pretrained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "tiny-pretrained")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert trained.model.embed_tokens.weight.dtype == torch.bfloat16
    before, after = pretrained.state_dict(), trained.state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k].to(after[k].dtype), after[k]) for k in before)


@pytest.mark.world_size(2)  # torchrun --nproc-per-node 2
def test_ops_demo(tmp_path):
    out = torchrun("ops_demo.py", cwd=tmp_path)
    assert out.count("matches torch.distributed") == 2


@pytest.mark.world_size(1)  # torchrun --nproc-per-node 1
def test_migration_guide_after_code_runs(tmp_path):
    """docs/migrating-from-deepspeed.md's "after" script, as printed, on one CPU process (eager
    backend to keep it fast): trains, evaluates, checkpoints and exports."""
    guide = (ROOT / "docs" / "migrating-from-deepspeed.md").read_text()
    marker = "<!-- after: tests/project/test_examples.py runs this block -->"
    assert marker in guide
    code = guide.split(marker, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert code.count("engine.compile()") == 1
    script = tmp_path / "after.py"
    script.write_text(code.replace("engine.compile()", 'engine.compile(backend="eager")'))
    out = torchrun(script, cwd=tmp_path, nproc=1, CUDA_VISIBLE_DEVICES="")
    assert "step 8: lr" in out  # 32 rows, micro-batch 2, 2 micro-batches per step: 8 steps
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step8"
    assert (tmp_path / "trained" / "config.json").exists()


def test_finetune_config_is_accepted_as_it_is():
    """The fine-tuning example's DeepSpeed config needs nothing filled in (no "auto" that only
    HF Trainer could resolve)."""
    from deepcompile import Config

    config = Config.from_any(json.loads((EXAMPLES / "finetune_config.json").read_text()))
    assert config.zero_optimization.stage == 3


def test_every_example_script_is_run_by_a_test():
    """A new example gets a test: here, or in a test file that names it."""
    scripts = {p.name for p in EXAMPLES.glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert RUN_HERE <= scripts
    # test_documented_commands.py names every example in its registry without running any.
    skip = {Path(__file__).name, "test_documented_commands.py"}
    other_tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name not in skip)
    untested = sorted(name for name in scripts - RUN_HERE if name not in other_tests)
    assert not untested, f"examples that no test runs: {untested}"
