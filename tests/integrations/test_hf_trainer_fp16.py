"""fp16 with dynamic loss scaling through transformers' Trainer on the served deepspeed.

examples/hf_trainer.py --fp16 on two gloo ranks on CPU, with a ZeRO-3 config whose fp16 section
is what users write (``"enabled": "auto"``, which Trainer fills from ``fp16=True``; ``loss_scale:
0`` for a dynamic scale starting at ``2**initial_scale_power``; ``hysteresis: 1`` so the first
overflow lowers it). On CPU, TrainingArguments accepts ``fp16=True``; the engine, not torch's
autocast, runs the model in fp16 (DeepSpeed's behaviour).

Two runs, identical except that one injects an overflow: at training micro-step POISON_STEP, on
rank 1 only, the gradient of the embedding output holds an inf (tests/_harness/hf_trainer_probe.py,
a forward hook given by a command-line argument, so nothing leaks into this process). Compared:

* before the skipped step, the runs are the same, bitwise (same ranks, same work);
* the step whose gradients overflowed is skipped on both ranks: ``optimizer.overflow`` true,
  each rank's parameter values unchanged (its shard of the fp32 masters, element by element), the
  loss scale halved (``optimizer.cur_scale``, as DeepSpeed users read it); the Trainer logs a
  non-finite grad norm for it and counts it as a step, as with DeepSpeed;
* after it, the training state is the clean run's one step earlier: parameters as after the
  clean run's previous step and the learning-rate schedule not advanced (the learning rates
  that follow are the clean run's, shifted by one step). The losses that follow are not
  compared: the Trainer's data order is not shifted (the step after the skipped one reads the
  next batch, not the skipped one), so they differ by design. Training continues on both ranks
  together: no other overflow, the same flags and scale on both, the loss still falls.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from _harness import hf_launch

ROWS, MICRO, ACCUM, WORLD = 48, 2, 2, 2
pytestmark = pytest.mark.world_size(WORLD)  # launched at WORLD ranks: ws2 in every test id (conftest.py)
STEPS = ROWS // (MICRO * ACCUM * WORLD)
POISON_STEP = 4  # a training micro-step, counted from 0: the first of optimizer step 3
SKIPPED = POISON_STEP // ACCUM  # that optimizer step's index, from 0
INITIAL_SCALE = 2.0 ** 8

CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1000,
             "hysteresis": 1, "min_loss_scale": 1},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    # Compiled (the served default), with the eager backend: quick on a CPU, and the loss scaling
    # under test is the engine's, not generated code's.
    "compile": {"backend": "eager"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_fp16")
    config = base / "ds_config_fp16.json"
    config.write_text(json.dumps(CONFIG))
    results = {}
    # The clean run installs the same (eager) hook, aimed at a step it never reaches, so that both
    # runs compile the same graphs and stay bitwise equal up to the overflow.
    for name, poison in (("clean", ["--poison-step", "1000000", "--poison-rank", "1"]),
                         ("poisoned", ["--poison-step", str(POISON_STEP), "--poison-rank", "1"])):
        hf_launch.torchrun(hf_launch.TRAINER_PROBE, [
            "--probe-out", str(base / f"{name}_probe"), "--save-shards", *poison, "--",
            "--deepspeed", str(config), "--fp16", "--micro-batch", str(MICRO), "--rows", str(ROWS),
            "--accumulation", str(ACCUM), "--output-dir", str(base / name), "--out", str(base / f"{name}.json")],
            nproc=WORLD)
        results[name] = {"log": hf_launch.read_json(base / f"{name}.json"),
                         "ranks": [hf_launch.read_json(f"{base / name}_probe.rank{r}.json") for r in range(WORLD)],
                         "shards": [torch.load(f"{base / name}_probe.rank{r}.shards.pt") for r in range(WORLD)]}
    return results


def _same_values(a, b) -> bool:
    """Two records of one rank's parameter shards (name -> values): equal element by element."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _per_step(result, key):
    return [entry[key] for entry in result["log"]["log_history"] if key in entry and "step" in entry]


def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale(runs):
    clean, poisoned = runs["clean"], runs["poisoned"]
    for rank in range(WORLD):
        c, p = clean["ranks"][rank], poisoned["ranks"][rank]
        assert c["fp16"] and p["fp16"]  # Trainer's fp16=True filled "enabled": "auto"
        assert len(c["scales"]) == len(p["scales"]) == STEPS
        assert [s["overflow"] for s in c["scales"]] == [False] * STEPS
        assert [s["scale"] for s in c["scales"]] == [INITIAL_SCALE] * STEPS
        assert [s["overflow"] for s in p["scales"]] == [i == SKIPPED for i in range(STEPS)], rank
        assert [s["scale"] for s in p["scales"]] == [INITIAL_SCALE if i < SKIPPED else INITIAL_SCALE / 2
                                                     for i in range(STEPS)], rank
        # Before the overflow the runs are one run; the skipped step leaves the values as they were.
        assert p["scales"][:SKIPPED] == c["scales"][:SKIPPED], rank
        ps, cs = poisoned["shards"][rank], clean["shards"][rank]
        assert len(ps) == len(cs) == STEPS and ps[0], rank
        assert all(_same_values(ps[i], cs[i]) for i in range(SKIPPED)), rank
        assert _same_values(ps[SKIPPED], ps[SKIPPED - 1]), rank
    for key in ("loss", "grad_norm", "learning_rate"):
        assert _per_step(poisoned, key)[:SKIPPED] == _per_step(clean, key)[:SKIPPED], key
    assert not math.isfinite(float(_per_step(poisoned, "grad_norm")[SKIPPED]))
    assert len(_per_step(poisoned, "loss")) == STEPS  # the skipped step counts as a Trainer step


def test_fp16_after_the_skipped_step_training_is_the_clean_run_one_step_behind(runs):
    clean, poisoned = runs["clean"], runs["poisoned"]
    # The schedule did not advance at the skipped step: the rates that follow are the clean run's
    # from the skipped step on.
    lrs, clean_lrs = _per_step(poisoned, "learning_rate"), _per_step(clean, "learning_rate")
    assert lrs[SKIPPED + 1:] == clean_lrs[SKIPPED:-1]
    assert lrs[SKIPPED + 1:] != clean_lrs[SKIPPED + 1:]  # the comparison above can fail
    for rank in range(WORLD):
        p, c = poisoned["shards"][rank], clean["shards"][rank]
        # After the skipped step each rank holds what it held after the clean run's step before it,
        # element by element.
        assert _same_values(p[SKIPPED], c[SKIPPED - 1]), rank
        assert not _same_values(p[SKIPPED + 1], p[SKIPPED]), rank  # and training goes on
        assert not _same_values(p[SKIPPED], c[SKIPPED]), rank  # the comparisons above can fail
    ranks = poisoned["ranks"]
    assert all([(s["overflow"], s["scale"]) for s in r["scales"]] == [(s["overflow"], s["scale"]) for s in ranks[0]["scales"]]
               for r in ranks)
    losses = _per_step(poisoned, "loss")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3
