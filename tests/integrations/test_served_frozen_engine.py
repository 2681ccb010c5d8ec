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


def _models():
    """The model to wrap and an identical plain copy (the same on every rank)."""
    torch.manual_seed(0)
    model = Tiny()
    plain = Tiny()
    plain.load_state_dict(model.state_dict())
    return model, plain


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


def _check_frozen(engine, plain, rank):
    """Forward equals the plain model's; training is refused with a message."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    assert not engine.training
    with torch.no_grad():
        torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=0)
    out = engine(x).sum()
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.backward(out)
    with pytest.raises((RuntimeError, AttributeError), match="optimizer"):
        engine.step()


def _trl_stage0_body(ctx):
    model, plain = _models()
    engine, said = _trl_reference(model, stage=2)
    from deepcompile.integrations.deepspeed_api import DeepSpeedEngine

    assert isinstance(engine, DeepSpeedEngine)  # accelerate unwraps by this type
    assert engine.module is model and engine.zero_optimization_stage() == 0 and not engine.zero_optimization()
    assert engine.config["zero_optimization"]["stage"] == 0 and engine.device == torch.device("cpu")
    assert [p.data_ptr() for p in engine.parameters()] == [p.data_ptr() for p in model.parameters()]
    assert engine.optimizer is None and not engine.bfloat16_enabled()
    assert not said, said
    _check_frozen(engine, plain, ctx.rank)


def _trl_zero3_body(ctx):
    model, plain = _models()
    engine, said = _trl_reference(model, stage=3)
    assert engine.zero_optimization_stage() == 3
    # TRL's three dotted keys: ignored, with one warning naming them.
    dotted = [m for m in said if "ignoring top-level config keys" in m]
    assert len(dotted) == 1 and "zero_optimization.reduce_bucket_size" in dotted[0], said
    assert not any("." in k for k in engine.config)
    assert engine.engine.compiled_as is None  # inference engines are not compiled by default
    _check_frozen(engine, plain, ctx.rank)


def _lightning_body(ctx, stage):
    from deepcompile.integrations import deepspeed_api

    model, plain = _models()
    config = {"train_micro_batch_size_per_gpu": 1, "compile": {"backend": "eager"}}
    if stage:
        config["zero_optimization"] = {"stage": stage}
    engine, optimizer, _, scheduler = deepspeed_api.initialize(
        args=argparse.Namespace(device_rank=0), config=config, model=model, optimizer=None, lr_scheduler=None,
        model_parameters=[], dist_init_required=False)
    assert optimizer is None and scheduler is None
    assert engine.zero_optimization_stage() == stage
    engine.eval()
    _check_frozen(engine, plain, ctx.rank)


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

    policy, plain = _models()
    reference, _ = _models()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "compile": {"backend": "eager"}}
    trained, *_ = deepspeed_api.initialize(model=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.5),
                                           config=config)
    frozen, *_ = deepspeed_api.initialize(model=reference, config=dict(config))
    frozen.eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    loss = trained(x).pow(2).mean()
    trained.backward(loss)
    trained.step()
    trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), plain(x), rtol=0, atol=0)
        assert not torch.equal(trained(x), plain(x)), "the trained engine's step did not show in its forward"


@pytest.mark.world_size(WORLD)
@pytest.mark.xfail(strict=True, reason="two ZeRO-3 engines in one process: once the second is built, the first's "
                                       "step no longer shows in its forward (docs/huggingface.md, Tested)")
def test_zero3_reference_beside_trained_engine():
    require_world_size(WORLD)
    run_distributed(_two_zero3_engines_body, world_size=WORLD)


def test_dpo_trainer_zero3_reference_model(tmp_path):
    """TRL's DPOTrainer with a reference model, ZeRO-3, two gloo ranks under torchrun, 2 steps."""
    pytest.importorskip("trl")
    import json

    from _harness import hf_launch, paths

    with open(f"{hf_launch.EXAMPLES}/ds_config_zero3.json") as f:
        config = json.load(f)
    config["compile"] = {"backend": "eager"}
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps(config))
    hf_launch.torchrun(str(paths.TESTS / "_harness" / "hf_dpo_worker.py"),
                       ["--deepspeed", str(ds_config), "--output-dir", str(tmp_path / "o"),
                        "--out", str(tmp_path / "out.json")], nproc=WORLD)
    out = hf_launch.read_json(tmp_path / "out.json")
    assert out["ref_engine"] == "DeepSpeedEngine" and out["ref_stage"] == 3
    steps = [e for e in out["log_history"] if "loss" in e]
    assert len(steps) == 2 and all(e["grad_norm"] > 0 for e in steps)
    # After one step the policy and the reference disagree (one process without DeepSpeed: margin
    # 0.07 on step 2); zero says the reference's forward ran the policy's weights or the policy's
    # update did not show.
    if steps[1]["rewards/margins"] == 0:
        pytest.xfail("step 2 margin is 0: the ZeRO-3 engines interfere (test_zero3_reference_beside_trained_engine)")
