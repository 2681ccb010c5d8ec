"""TRL's SFTTrainer with DeepSpeed ZeRO-3 running on deepcompile, and the served
``deepspeed.zero.GatheredParameters`` it relies on.

TRL (1.16) computes SFTTrainer's loss with a fused LM head that reads ``lm_head.weight``
directly, outside the head module's forward, inside ``GatheredParameters`` (again in its
backward) after checking ``param.ds_status``. The trainer test runs it on two gloo ranks with
examples/ds_config_zero3.json against the same SFTTrainer without DeepSpeed in one process on the
same global batches, each split in two micro-batches as the ranks split it (accumulated over two
micro-steps); the unit test checks the context itself on two ranks.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _harness import hf_launch, paths
from _harness.multiproc import require_world_size, run_distributed

pytest.importorskip("trl")

WORKER = str(paths.TESTS / "_harness" / "hf_sft_worker.py")
DS_CONFIG = os.path.join(hf_launch.EXAMPLES, "ds_config_zero3.json")
ROWS, MICRO, WORLD = 16, 2, 2
STEPS = ROWS // (MICRO * WORLD)
# fp32 on CPU; both runs compute the same half-batch gradients and differ at most in how the two
# are summed (the reduce-scatter's average against accumulation): measured bitwise equal over 4
# AdamW steps. Against one whole-batch micro-step instead, summation order alone reaches ~2e-5
# relative on the third step's grad norm (AdamW at lr 1e-2 amplifies it), hence this reference.
# The served engine compiles with Inductor by default (compile.auto_compile), whose fused kernels
# sum in other orders than the eager reference: measured 7.4e-6 relative on the fourth step's
# loss and 5.5e-5 on its grad norm, which AdamW at lr 1e-2 amplifies (TRL's fused loss gathers the
# LM head, so that function runs eagerly, the rest compiled). A lost or unreduced lm_head gradient
# changes the grad norm by tens of percent.
TOL = dict(rtol=2e-4, atol=2e-4)


@pytest.mark.world_size(WORLD)  # torchrun at WORLD ranks
def test_sft_trainer_zero3_matches_single_process(tmp_path):
    hf_launch.torchrun(WORKER, ["--deepspeed", DS_CONFIG, "--micro-batch", str(MICRO), "--rows", str(ROWS),
                                "--output-dir", str(tmp_path / "ds"), "--out", str(tmp_path / "ds.json")], nproc=WORLD)
    hf_launch.run_checked([sys.executable, WORKER, "--micro-batch", str(MICRO), "--accumulation", str(WORLD),
                           "--rows", str(ROWS),
                           "--output-dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.json")],
                          env=hf_launch.launch_env())
    ds, ref = hf_launch.read_json(tmp_path / "ds.json"), hf_launch.read_json(tmp_path / "ref.json")
    assert ds["engine"] == "deepcompile.integrations.deepspeed_api.engine" and ds["world_size"] == WORLD
    assert ref["world_size"] == 1
    for key in ("loss", "grad_norm", "mean_token_accuracy"):
        got = [e[key] for e in ds["log_history"] if key in e and "step" in e]
        want = [e[key] for e in ref["log_history"] if key in e and "step" in e]
        assert len(got) == len(want) == STEPS, key
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m: f"{key}: {m}")
    losses = [e["loss"] for e in ds["log_history"] if "loss" in e]
    assert losses[-1] < losses[0] - 0.2  # it learned


CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "gradient_accumulation_steps": 1}
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _body_gathered_parameters(ctx):
    import deepcompile
    from deepcompile.integrations.deepspeed_api.runtime.zero.partition_parameters import ZeroParamStatus
    from deepcompile.integrations.deepspeed_api.zero import GatheredParameters

    torch._dynamo.reset()
    dev = ctx.device
    model, reference = _model().to(dev), _model().to(dev)
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), CONFIG)
    rank = dist.get_rank()
    names = dict(model.named_parameters())
    full = engine.full_state_dict(all_ranks=True)
    for name, p in names.items():
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE, name
        assert p.ds_numel == full[name].numel() and tuple(p.ds_shape) == tuple(full[name].shape), name

    # Inside: every rank holds the full values, the ones full_state_dict gathers.
    with GatheredParameters(list(names.values())):
        for name, p in names.items():
            assert p.ds_status is ZeroParamStatus.AVAILABLE, name
            torch.testing.assert_close(p.data, full[name].to(dev), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    for name, p in names.items():
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE, name
        with pytest.raises(RuntimeError, match="is partitioned by ZeRO-3"):  # the placeholder is back
            p.data.sum()

    # modifier_rank=0: rank 0's change reaches every rank's shard; the other rank's is discarded.
    weight = names["2.weight"]
    with GatheredParameters([weight], modifier_rank=0):
        with torch.no_grad():
            weight.data.mul_(2.0 if rank == 0 else -5.0)
    full["2.weight"] = full["2.weight"] * 2.0
    reference.load_state_dict(full)
    x = torch.linspace(-1, 1, 4 * 6, device=dev).view(4, 6)
    out = engine(x)
    torch.testing.assert_close(out, reference(x), msg=lambda m: f"forward after modifier_rank=0: {m}")

    # A gradient through the gathered value, outside any module's forward, is reduced into the
    # partition (as TRL's fused head's is): the step equals the reference's. The term is linear in
    # the weight: a backward that reads the values must gather them again (TRL's does), since
    # after the block the parameter holds its placeholder.
    coeff = torch.linspace(-1, 1, weight.numel(), device=dev).view(weight.shape)
    with GatheredParameters([weight]):
        extra = (weight * coeff).sum()
    engine.backward(out.sum() + extra)
    engine.step()
    assert weight.grad is None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    (reference(x).sum() + (reference[2].weight * coeff).sum()).backward()
    ref_opt.step()
    after = engine.full_state_dict(all_ranks=True)
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(after[name], want.cpu(), msg=lambda m: f"{name} after a step: {m}")
    engine.destroy()


@pytest.mark.world_size(2)
def test_gathered_parameters_two_ranks():
    require_world_size(2)
    run_distributed(_body_gathered_parameters, world_size=2)
