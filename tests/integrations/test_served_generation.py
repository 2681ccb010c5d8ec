"""Generation inside a ZeRO-3 training run (issue 41): TRL's GRPOTrainer (with a reference model,
beta > 0), whose every rollout goes through ``unwrap_model_for_generation`` (a whole-model ``GatheredParameters`` with DeepSpeed's
module hooks removed through ``engine.optimizer.parameter_offload`` and put back after), served by
deepcompile on two gloo ranks. Before ``parameter_offload`` was served the run failed at the
first rollout (``'OptimizerView' object has no attribute 'module'``)."""

import pytest

from _harness import hf_launch

WORLD = 2
pytestmark = pytest.mark.world_size(WORLD)  # launched at WORLD ranks: ws2 in every test id (conftest.py)


def test_grpo_trainer_generates_under_zero3(tmp_path):
    pytest.importorskip("trl")
    out = hf_launch.run_trl_worker("hf_grpo_worker.py", tmp_path, nproc=WORLD)
    counts = out["counts"]
    assert out["stage"] == 3
    steps = [e for e in out["log_history"] if "loss" in e]
    assert len(steps) == 2, out["log_history"]
    assert counts["generate_calls"] >= 2, counts
    # Generation saw the gathered weights (full shapes, finite: not the NaN placeholders) and the
    # engine's eager hooks stood aside: nothing gathered again per generated token.
    assert counts["full_finite_weights"] and counts["hooks_suspended_in_generate"], counts
    assert counts["eager_gathers_in_generate"] == 0, counts
    assert counts["hooks_suspended_after"] is False, counts  # add_hooks put them back for training
    # beta > 0: the reference model, loaded from the policy's files, is the frozen ZeRO-3 engine
    # (no second deepcompile engine beside the trained one), and the KL term is computed against
    # it: zero before the first update (same weights), positive once the policy moved.
    assert out["ref_engine"].endswith("frozen_zero3"), out["ref_engine"]
    kl = [e["kl"] for e in steps]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 0, kl


def test_grpo_trainer_generates_under_zero2(tmp_path):
    """The same GRPO run at ZeRO-2: the weights are whole, generation gathers nothing, and TRL's
    reference model is the stage-0 frozen engine it asks for at ZeRO-1/2."""
    pytest.importorskip("trl")
    out = hf_launch.run_trl_worker("hf_grpo_worker.py", tmp_path, nproc=WORLD, stage=2)
    counts = out["counts"]
    assert out["stage"] == 2
    steps = [e for e in out["log_history"] if "loss" in e]
    assert len(steps) == 2, out["log_history"]
    assert counts["generate_calls"] >= 2 and counts["full_finite_weights"], counts
    assert counts["eager_gathers_in_generate"] == 0 and counts["hooks_suspended_after"] is None, counts
    assert out["ref_engine"].endswith("frozen_engine"), out["ref_engine"]
    kl = [e["kl"] for e in steps]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 0, kl
