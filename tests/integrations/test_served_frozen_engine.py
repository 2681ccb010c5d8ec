"""The served ``deepspeed.initialize`` for a frozen model (issue 41): TRL's reference/teacher model
(``trl.models.utils.prepare_deepspeed``, called here as TRL calls it) at stage 0 and at ZeRO-3
with its dotted top-level keys, and Lightning's inference path (``model_parameters=[]``).

Each engine's forward must equal the plain model's, and backward/step must be refused with a
message. Two gloo ranks; the served package stands in for ``deepspeed`` only while TRL's function
runs (the pooled workers are shared with other tests).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import require_world_size, run_distributed

WORLD = 2
HIDDEN = 8


class Tiny(nn.Module):
    """A model with a ``config.hidden_size``, which TRL reads to size its ZeRO-3 keys."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=HIDDEN)
        self.fc1 = nn.Linear(4, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _models(device=None):
    """The model to wrap and an identical plain copy (the same on every rank), the copy on
    ``device`` (the test's device: DeepSpeed places the wrapped model there itself)."""
    torch.manual_seed(0)
    model = Tiny()
    plain = Tiny()
    plain.load_state_dict(model.state_dict())
    return model, plain.to(device or "cpu")


def _training_config(stage):
    """The config of the trainer's model as accelerate holds it once Trainer filled its "auto"
    values (the ZeRO-3 sizes stay "auto" until training starts): TRL copies it for the reference."""
    zero = {"stage": stage, "overlap_comm": True, "offload_optimizer": {"device": "none"}}
    if stage == 3:
        zero.update(reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                    stage3_param_persistence_threshold="auto", stage3_gather_16bit_weights_on_model_save=True)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
            "gradient_clipping": 1.0, "bf16": {"enabled": False}, "steps_per_print": float("inf"),
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                         "warmup_num_steps": 0}},
            "compile": {"backend": "eager"}, "zero_optimization": zero}


@contextlib.contextmanager
def _served():
    """``import deepspeed`` gives deepcompile's package while inside."""
    from deepcompile.integrations import deepspeed_api

    before = sys.modules.get("deepspeed")
    sys.modules["deepspeed"] = deepspeed_api
    try:
        yield deepspeed_api
    finally:
        if before is None:
            del sys.modules["deepspeed"]
        else:
            sys.modules["deepspeed"] = before


def _trl_reference(model, stage):
    from trl.models.utils import prepare_deepspeed

    plugin = types.SimpleNamespace(deepspeed_config=_training_config(stage))
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin))
    with _served(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = prepare_deepspeed(model, accelerator)
    return engine, [str(w.message) for w in caught]


def _check_frozen(engine, plain, rank, device):
    """Forward equals the plain model's; training is refused with a message."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)).to(device)
    assert not engine.training
    with torch.no_grad():
        torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=0)
    out = engine(x).sum()
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.backward(out)
    with pytest.raises((RuntimeError, AttributeError), match="optimizer"):
        engine.step()


def _trl_stage0_body(ctx):
    model, plain = _models(ctx.device)
    engine, said = _trl_reference(model, stage=2)
    from deepcompile.integrations.deepspeed_api import DeepSpeedEngine

    assert isinstance(engine, DeepSpeedEngine)  # accelerate unwraps by this type
    assert engine.module is model and engine.zero_optimization_stage() == 0 and not engine.zero_optimization()
    assert engine.config["zero_optimization"]["stage"] == 0 and engine.device.type == ctx.device.type
    assert [p.data_ptr() for p in engine.parameters()] == [p.data_ptr() for p in model.parameters()]
    assert engine.optimizer is None and not engine.bfloat16_enabled()
    assert not said, said
    _check_frozen(engine, plain, ctx.rank, ctx.device)


def _trl_zero3_body(ctx):
    model, plain = _models(ctx.device)
    engine, said = _trl_reference(model, stage=3)
    assert engine.zero_optimization_stage() == 3
    # TRL's three dotted keys: ignored, with one warning naming them.
    dotted = [m for m in said if "ignoring top-level config keys" in m]
    assert len(dotted) == 1 and "zero_optimization.reduce_bucket_size" in dotted[0], said
    assert not any("." in k for k in engine.config)
    # Partitioned without deepcompile's engine (frozen_zero3.py): nothing compiled, no runtime.
    assert type(engine).__name__ == "FrozenZero3Engine" and engine.zero_optimization()
    _check_frozen(engine, plain, ctx.rank, ctx.device)


def _lightning_body(ctx, stage):
    from deepcompile.integrations import deepspeed_api

    model, plain = _models(ctx.device)
    config = {"train_micro_batch_size_per_gpu": 1, "compile": {"backend": "eager"}}
    if stage:
        config["zero_optimization"] = {"stage": stage}
    engine, optimizer, _, scheduler = deepspeed_api.initialize(
        args=argparse.Namespace(device_rank=0), config=config, model=model, optimizer=None, lr_scheduler=None,
        model_parameters=[], dist_init_required=False)
    assert optimizer is None and scheduler is None
    assert engine.zero_optimization_stage() == stage
    engine.eval()
    _check_frozen(engine, plain, ctx.rank, ctx.device)


def _refusals_body(ctx):
    from deepcompile.integrations import deepspeed_api

    model, _ = _models()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no stage 0 training"):
        deepspeed_api.initialize(model=model, optimizer=optimizer, config={"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(ValueError, match="no stage 0 training"):
        deepspeed_api.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                      "zero_optimization": {"stage": 0},
                                                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    # bf16 as DeepSpeed casts an unpartitioned model.
    engine, *_ = deepspeed_api.initialize(model=model, config={"bf16": {"enabled": True},
                                                               "zero_optimization": {"stage": 0}})
    assert engine.bfloat16_enabled() and {p.dtype for p in engine.parameters()} == {torch.bfloat16}
    # The same at ZeRO-3, where each rank holds bf16 shards and gathers them per module.
    from deepcompile.integrations.deepspeed_api.frozen_shards import shard_of

    model, plain = _models(ctx.device)
    engine, *_ = deepspeed_api.initialize(model=model, config={"bf16": {"enabled": True},
                                                               "zero_optimization": {"stage": 3}})
    assert engine.bfloat16_enabled() and {shard_of(p).local.dtype for p in model.parameters()} == {torch.bfloat16}
    x = torch.randn(3, 4, device=ctx.device)
    torch.testing.assert_close(engine(x.bfloat16()), plain.bfloat16()(x.bfloat16()), rtol=0, atol=0)


def _direct_api_stays_strict():
    import deepcompile

    with pytest.raises(ValueError, match="stage 0"):
        deepcompile.Config.from_any({"zero_optimization": {"stage": 0}})
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size"):
        deepcompile.Config.from_any({"zero_optimization": {"stage": 3}, "zero_optimization.reduce_bucket_size": 1})


@pytest.mark.world_size(WORLD)
def test_trl_reference_model_stage0():
    pytest.importorskip("trl")
    require_world_size(WORLD)
    run_distributed(_trl_stage0_body, world_size=WORLD)


@pytest.mark.world_size(WORLD)
def test_trl_reference_model_zero3_dotted_keys():
    pytest.importorskip("trl")
    require_world_size(WORLD)
    run_distributed(_trl_zero3_body, world_size=WORLD)


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("stage", [0, 3])
def test_lightning_inference_empty_model_parameters(stage):
    require_world_size(WORLD)
    run_distributed(_lightning_body, world_size=WORLD, args=(stage,))


@pytest.mark.world_size(WORLD)
def test_stage0_training_refused_and_bf16_cast():
    require_world_size(WORLD)
    run_distributed(_refusals_body, world_size=WORLD)
    _direct_api_stays_strict()


# ---- a ZeRO-3 reference model next to the trained model ---------------------------------------------

def _two_zero3_engines_body(ctx):
    from deepcompile.integrations import deepspeed_api

    policy, plain = _models(ctx.device)
    reference, _ = _models()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "compile": {"backend": "eager"}}
    trained, *_ = deepspeed_api.initialize(model=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.5),
                                           config=config)
    frozen, *_ = deepspeed_api.initialize(model=reference, config=dict(config))
    frozen.eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    loss = trained(x).pow(2).mean()
    trained.backward(loss)
    trained.step()
    trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), plain(x), rtol=0, atol=0)
        assert not torch.equal(trained(x), plain(x)), "the trained engine's step did not show in its forward"


@pytest.mark.world_size(WORLD)
def test_zero3_reference_beside_trained_engine():
    require_world_size(WORLD)
    run_distributed(_two_zero3_engines_body, world_size=WORLD)


@pytest.mark.world_size(WORLD)  # its worker at WORLD ranks
def test_dpo_trainer_zero3_reference_model(tmp_path):
    """TRL's DPOTrainer with a reference model, ZeRO-3, two gloo ranks under torchrun, 2 steps."""
    pytest.importorskip("trl")
    from _harness import hf_launch

    out = hf_launch.run_trl_worker("hf_dpo_worker.py", tmp_path, nproc=WORLD)
    assert out["ref_engine"] == "FrozenZero3Engine" and out["ref_stage"] == 3  # a DeepSpeedEngine, no runtime
    steps = [e for e in out["log_history"] if "loss" in e]
    assert len(steps) == 2 and all(e["grad_norm"] > 0 for e in steps)
    # After one step the policy and the reference disagree (one process without DeepSpeed: margin
    # 0.07 on step 2); zero says the reference's forward ran the policy's weights or the policy's
    # update did not show (issue 41: two ZeRO-3 engines in one process).
    assert steps[1]["rewards/margins"] != 0, steps


@pytest.mark.world_size(WORLD)  # its worker at WORLD ranks
def test_dpo_trainer_zero2_reference_model(tmp_path):
    """The same DPO run at ZeRO-2: TRL hands the reference model over at stage 0, which the frozen
    engine runs whole on every rank (before issue 41: "stage 0 is not supported")."""
    pytest.importorskip("trl")
    from _harness import hf_launch

    out = hf_launch.run_trl_worker("hf_dpo_worker.py", tmp_path, nproc=WORLD, stage=2)
    assert out["ref_engine"] == "FrozenEngine" and out["ref_stage"] == 0
    steps = [e for e in out["log_history"] if "loss" in e]
    assert len(steps) == 2 and all(e["grad_norm"] > 0 for e in steps)
    assert steps[1]["rewards/margins"] != 0, steps


# ---- the frozen ZeRO-3 engine itself --------------------------------------------------------------

def _partitioned_body(ctx, built_in_init):
    from deepcompile.integrations import deepspeed_api
    from deepcompile.integrations.deepspeed_api import frozen_shards

    torch.manual_seed(ctx.rank)  # differently seeded ranks: the engine must run rank 0's values
    plain = Tiny()
    if built_in_init:
        with deepspeed_api.zero.Init():
            model = Tiny()
        with deepspeed_api.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if ctx.rank == 0:
                model.load_state_dict(plain.state_dict())
    else:
        model = Tiny()
        model.load_state_dict(plain.state_dict())
    plain.to(ctx.device)
    for p in plain.parameters():  # the plain model: rank 0's values everywhere
        torch.distributed.broadcast(p.data, src=0)
    engine, optimizer, _, scheduler = deepspeed_api.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    assert optimizer is None and scheduler is None and engine.module is model
    with pytest.raises(RuntimeError, match="save_16bit_model"):
        engine.save_checkpoint("unused")
    engine.eval()

    def holds_only_shards():
        want = {name: -(-p.numel() // WORLD) for name, p in plain.named_parameters()}
        assert frozen_shards.held_elements(model) == want
        assert all(p.numel() == 0 and p.ds_status.name == "NOT_AVAILABLE" for p in model.parameters())

    holds_only_shards()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    for _ in range(2):
        out = engine(x)
        torch.testing.assert_close(out, plain(x).detach(), rtol=0, atol=0)
        assert not out.requires_grad
        holds_only_shards()
    # GatheredParameters gathers this engine's parameters; modifier_rank=0's change is kept.
    with deepspeed_api.zero.GatheredParameters([model.fc2.bias], modifier_rank=0):
        torch.testing.assert_close(model.fc2.bias.data, plain.fc2.bias.data, rtol=0, atol=0)
        with torch.no_grad():
            model.fc2.bias.add_(1.0 + ctx.rank)  # rank 1's change is discarded
    with torch.no_grad():
        plain.fc2.bias.add_(1.0)
    torch.testing.assert_close(engine(x), plain(x).detach(), rtol=0, atol=0)
    holds_only_shards()
    state = engine._zero3_consolidated_16bit_state_dict()
    if ctx.rank == 0:
        assert state.keys() == plain.state_dict().keys()
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(state[key].to(value.device), value, rtol=0, atol=0)
    else:
        assert state == {}


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("built_in_init", [False, True], ids=["plain", "zero_init"])
def test_zero3_frozen_engine_partitioned_forward(built_in_init):
    """Each rank holds only its shard between forwards; forward equals the plain model's."""
    require_world_size(WORLD)
    run_distributed(_partitioned_body, world_size=WORLD, args=(built_in_init,))


def _frozen_then_trained_body(ctx):
    """Trainer's evaluate() before train(): the frozen engine's model is then given to a training
    engine, which takes the shards' values."""
    from deepcompile.integrations import deepspeed_api

    model, plain = _models(ctx.device)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "compile": {"backend": "eager"}}
    deepspeed_api.initialize(model=model, config=dict(config))
    trained, *_ = deepspeed_api.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                           config=config)
    trained.eval()
    x = torch.randn(2, 4, device=ctx.device)
    with torch.no_grad():
        torch.testing.assert_close(trained(x), plain(x), rtol=0, atol=0)


@pytest.mark.world_size(WORLD)
def test_zero3_frozen_model_then_trained():
    require_world_size(WORLD)
    run_distributed(_frozen_then_trained_body, world_size=WORLD)
