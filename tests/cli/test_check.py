"""``deepcompile check`` (deepcompile/cli/check.py), run in-process (no subprocess: fast):

* ``--trainer`` / ``--accelerate``: the ``"auto"`` values HF Trainer or accelerate fill are listed
  with where they come from, and the config is judged as they hand it over: every shipped Trainer
  config passes, a real problem still fails, and without the option the refusal points to it;
* every independent problem comes in one run (a refused key does not hide the checks of the rest),
  and a problem shared by several keys is printed once.
"""

from __future__ import annotations

import json
import os

import pytest

from deepcompile.cli import main
from deepcompile.config import Config, ConfigError
from _harness.paths import ROOT

TRAINER_CONFIGS = ["ds_config_zero3.json", "ds_config_zero3_hf.json", "ds_config_zero3_offload.json"]
ALL_BATCH_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto"}


def _check(capsys, config, *args, tmp=None):
    if isinstance(config, dict):
        path = tmp / "ds_config.json"
        path.write_text(json.dumps(config))
        config = str(path)
    code = main(["check", config, *args])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", TRAINER_CONFIGS)
def test_shipped_trainer_configs_pass_under_trainer(capsys, name):
    path = os.path.join(ROOT, "examples", name)
    code, out = _check(capsys, path, "--world-size", "2")
    assert code == 1 and "--trainer" in out, out  # refused as a plain config, pointing to --trainer
    code, out = _check(capsys, path, "--world-size", "2", "--trainer")
    assert code == 0, out
    assert "OK at world size 2 as HF Trainer hands it over" in out, out
    assert "gradient_clipping: TrainingArguments.max_grad_norm" in out, out
    assert "train_micro_batch_size_per_gpu: TrainingArguments.per_device_train_batch_size" in out, out
    # The hidden-size keys are left to deepcompile, which derives what Trainer would.
    assert "zero_optimization.reduce_bucket_size: depends on the model" in out, out


def test_accelerate_fills_fewer_keys(capsys):
    path = os.path.join(ROOT, "examples", "ds_config_zero3_hf.json")
    code, out = _check(capsys, path, "--world-size", "2", "--accelerate")
    # accelerate fills lr and weight_decay (from a DummyOptim), not betas or eps.
    assert code == 1, out
    assert "optimizer.params.betas is \"auto\"" in out and "optimizer.params.eps is \"auto\"" in out, out
    assert "optimizer.params.lr is \"auto\"" not in out and "gradient_clipping is \"auto\"" not in out, out


def test_trainer_mode_still_reports_real_problems(capsys, tmp_path):
    with open(os.path.join(ROOT, "examples", "ds_config_zero3.json"), encoding="utf-8") as f:
        raw = json.load(f)
    raw["zero_optimization"]["zero_hpz_partition_size"] = 3
    raw["train_batch_size"] = 6  # Trainer computes world * per-device * accumulation: 6 is no multiple of 4
    code, out = _check(capsys, raw, "--world-size", "4", "--trainer", tmp=tmp_path)
    assert code == 1, out
    assert "zero_hpz_partition_size is 3, which does not divide the world size 4" in out, out
    assert "train_batch_size (6) must be divisible" in out, out


def test_batch_size_problem_is_printed_once(capsys, tmp_path):
    code, out = _check(capsys, {**ALL_BATCH_AUTO, "zero_optimization": {"stage": 3}}, "--world-size", "2",
                       tmp=tmp_path)
    assert code == 1
    assert out.count("at most one of") == 1, out
    assert "1 problem(s)" in out, out
    with pytest.raises(ConfigError) as e:  # the exception's text too
        Config.from_any({**ALL_BATCH_AUTO, "zero_optimization": {"stage": 3}}).resolve(2)
    assert str(e.value).count("at most one of") == 1, str(e.value)


def test_every_independent_problem_in_one_run(capsys, tmp_path):
    # A key refused while parsing (gradient_clipping "auto", an unknown key) used to hide the
    # batch sizes, which are checked after parsing, and the rules across sections.
    config = {"gradient_clipping": "auto", "train_batch_size": 6, "train_micro_batch_size_per_gpu": 4,
              "zero_optimization": {"stage": 3, "bogus": 1}}
    code, out = _check(capsys, config, "--world-size", "2", tmp=tmp_path)
    assert code == 1
    assert "3 problem(s)" in out, out
    assert "gradient_clipping is \"auto\"" in out and "zero_optimization.bogus" in out, out
    assert "train_batch_size (6) must be divisible" in out, out
    config = {"gradient_clipping": 1.0, "compile": {"optimizer_step_in_backward": True},
              "zero_optimization": {"stage": 3, "bogus": 1}}
    code, out = _check(capsys, config, "--world-size", "2", tmp=tmp_path)
    assert code == 1 and "2 problem(s)" in out, out
    assert "zero_optimization.bogus" in out and "compile.optimizer_step_in_backward cannot be used here" in out, out


def test_check_without_world_size_says_it_assumed_one(capsys, tmp_path):
    """A config can be valid at one rank and not at the run's world size (batch sizes): check
    says which world size it checked when none was given."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}}
    code, out = _check(capsys, config, tmp=tmp_path)
    assert "no --world-size given: checking at world size 1" in out, out
    assert code == 1, out  # 8 != 4 x 1 x 1 rank; right at 2 ranks
    code, out = _check(capsys, config, "--world-size", "2", tmp=tmp_path)
    assert code == 0 and "no --world-size given" not in out, out
