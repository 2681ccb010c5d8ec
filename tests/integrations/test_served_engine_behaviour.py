"""The served ``deepspeed.DeepSpeedEngine`` where it behaved differently from DeepSpeed's (issue 41):
attribute forwarding to the module, ``was_step_applied()``, ``load_checkpoint`` with no checkpoint,
``save_16bit_model`` under ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``,
``_consolidated_16bit_state_dict``, ``tput_timer``, and ``ds_id``/``ds_status`` only on ZeRO-3
parameters (the LoRA/projector save of LLaVA, FastChat, Qwen, InternVL, DeepSpeed-Chat).

Two gloo ranks, eager (``compile.auto_compile`` off), through ``deepspeed_api.initialize`` (what the
served ``deepspeed.initialize`` is) without serving the package in the worker processes.
"""

from __future__ import annotations

import math
import os
import time
import warnings

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import require_world_size, run_distributed
from _harness.poison_grad import PoisonGrad

WORLD = 2
MICRO = 2
GAS = 2


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.checkpointing = False
        self.poison = False  # fp16 tests: fc1's output gradient gets an inf
        self.delay_s = 0.0  # tput_timer test: a forward that takes known wall time

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.checkpointing = True

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)
        h = self.fc1(x)
        if self.poison:
            h = PoisonGrad.apply(h)
        return self.fc2(torch.relu(h))


def _config(stage, **extra):
    zero = {"stage": stage, **extra.pop("zero", {})}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "zero_optimization": zero, "compile": {"auto_compile": False}, **extra}


def _engine(stage, **extra):
    from deepcompile.integrations import deepspeed_api

    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed_api.initialize(model=model, optimizer=optimizer, config=_config(stage, **extra))
    return engine


def _micro_step(engine, rank, k):
    x = torch.randn(MICRO, 4, generator=torch.Generator().manual_seed(100 * rank + k))
    x = x.to(next(engine.module.parameters()).dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def maybe_zero_3(param):
    """LLaVA's / FastChat's / DeepSpeed-Chat's LoRA and projector save, verbatim in substance."""
    from deepcompile.integrations.deepspeed_api.runtime.zero.partition_parameters import ZeroParamStatus
    from deepcompile.integrations.deepspeed_api.zero import GatheredParameters

    if hasattr(param, "ds_id"):
        assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE
        with GatheredParameters([param]):
            return param.data.detach().cpu().clone()
    return param.detach().cpu().clone()


# ---- ZeRO-2: forwarding, was_step_applied, tput_timer, no ds_id, load_checkpoint, 16-bit saves ----


def _zero12_body(ctx, stage, root):
    import torch.distributed as dist

    from deepcompile.checkpoint.agreement import CheckpointError
    from deepcompile.integrations.deepspeed_api._missing import NotImplementedByDeepcompile

    engine = _engine(stage)

    # Attributes the engine lacks are the module's (DeepSpeed-Chat); still a clear error otherwise.
    engine.gradient_checkpointing_enable()
    assert engine.module.checkpointing is True
    assert engine.delay_s == 0.0 and engine.fc1 is engine.module.fc1
    with pytest.raises(NotImplementedByDeepcompile, match=r"DeepSpeedEngine\.no_such_thing"):
        engine.no_such_thing
    assert not hasattr(engine, "no_such_thing")
    assert isinstance(engine.config, dict)  # the engine's own attributes stay its own

    # ZeRO-1/2 parameters carry neither ds_id nor ds_status, as in DeepSpeed: the LoRA save works.
    for name, p in engine.module.named_parameters():
        assert not hasattr(p, "ds_id") and not hasattr(p, "ds_status"), name
        assert torch.equal(maybe_zero_3(p), p.detach().cpu()), name

    # was_step_applied: False before any step and between boundaries, True after an applied step.
    assert engine.was_step_applied() is False
    engine.module.delay_s = 0.02
    for k in range(2 * GAS):
        _micro_step(engine, ctx.rank, k)
        assert engine.was_step_applied() is ((k + 1) % GAS == 0), k
    engine.module.delay_s = 0.0
    # accelerate's form: the boundary set before each backward, step() after every micro-batch.
    for k in range(GAS):
        engine.set_gradient_accumulation_boundary(k == GAS - 1)
        _micro_step(engine, ctx.rank, 10 + k)
        assert engine.was_step_applied() is (k == GAS - 1), k
    assert engine.global_steps == 3

    # tput_timer: real wall time (each micro-step slept 20 ms in the forward) over the timed steps.
    timer = engine.tput_timer
    assert timer.global_step_count == 3 and timer.micro_step_count == 3 * GAS
    assert timer.total_elapsed_time >= 2 * GAS * 0.02
    rate = timer.avg_samples_per_sec()
    assert rate == pytest.approx(engine.train_batch_size() * 3 / timer.total_elapsed_time)
    assert 0 < rate <= engine.train_batch_size() * 3 / (2 * GAS * 0.02)
    timer.start()
    time.sleep(0.01)
    timer.stop(global_step=True, report_speed=False)
    assert timer.global_step_count == 4 and timer.total_elapsed_time >= 2 * GAS * 0.02 + 0.01

    # _consolidated_16bit_state_dict (OpenRLHF): rank 0 the full weights, the others {}.
    state = engine._consolidated_16bit_state_dict()
    if ctx.rank == 0:
        want = engine.module.state_dict()
        assert state.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(state[k].cpu(), v.cpu()), k
    else:
        assert state == {}
    assert engine.save_16bit_model(os.path.join(root, f"z{stage}_16bit")) is True
    dist.barrier()
    assert os.path.isfile(os.path.join(root, f"z{stage}_16bit", "pytorch_model.bin"))

    # load_checkpoint with nothing to load: (None, None) and a warning, as DeepSpeed (OpenRLHF).
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    empty = os.path.join(root, f"z{stage}_empty")
    if ctx.rank == 0:
        os.makedirs(empty)
    dist.barrier()
    for where in (os.path.join(root, f"z{stage}_missing"), empty):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert engine.load_checkpoint(where) == (None, None), where
        assert any("latest" in str(w.message) for w in caught), where
    assert engine.global_steps == 3  # the manual timer stop above stepped nothing
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, before[k]), k

    # ... but a checkpoint that is there and broken, or a tag that is not there, still raises.
    ckpt = os.path.join(root, f"z{stage}_ckpt")
    engine.save_checkpoint(ckpt, tag="t1")
    path, _ = engine.load_checkpoint(ckpt)
    assert os.path.basename(path) == "t1"
    with pytest.raises(CheckpointError):
        engine.load_checkpoint(ckpt, tag="t2")
    dist.barrier()
    if ctx.rank == 0:
        with open(os.path.join(ckpt, "latest"), "w") as f:
            f.write("gone")
    dist.barrier()
    with pytest.raises(CheckpointError, match="gone"):
        engine.load_checkpoint(ckpt)
    engine.destroy()


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_engine_behaves_as_deepspeeds(stage, tmp_path):
    require_world_size(WORLD)
    run_distributed(_zero12_body, world_size=WORLD, args=(stage, str(tmp_path)))


# ---- ZeRO-3: save_16bit_model honours the config; ds_id and ds_status are there --------------------


def _zero3_body(ctx, root):
    import torch.distributed as dist

    from deepcompile.integrations.deepspeed_api.runtime.zero.partition_parameters import ZeroParamStatus

    engine = _engine(3)
    for name, p in engine.module.named_parameters():
        assert hasattr(p, "ds_id") and p.ds_status is ZeroParamStatus.NOT_AVAILABLE, name
    full = {n: maybe_zero_3(p) for n, p in engine.module.named_parameters()}
    assert all(torch.isfinite(v).all() for v in full.values())

    # Without stage3_gather_16bit_weights_on_model_save: nothing written, False, a warning.
    target = os.path.join(root, "z3_16bit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.save_16bit_model(target) is False
    assert any("stage3_gather_16bit_weights_on_model_save" in str(w.message) for w in caught)
    dist.barrier()
    assert not os.path.exists(target)

    state = engine._consolidated_16bit_state_dict()
    if ctx.rank == 0:
        assert state.keys() == full.keys()
        for k, v in full.items():
            assert torch.equal(state[k].cpu(), v), k
    else:
        assert state == {}
    engine.destroy()

    engine = _engine(3, zero={"stage3_gather_16bit_weights_on_model_save": True})
    assert engine.save_16bit_model(target) is True
    dist.barrier()
    saved = torch.load(os.path.join(target, "pytorch_model.bin"))
    assert saved.keys() == full.keys()
    for k, v in full.items():
        assert torch.equal(saved[k], v), k
    engine.destroy()


@pytest.mark.world_size(WORLD)
def test_zero3_save_16bit_model_follows_the_config(tmp_path):
    require_world_size(WORLD)
    run_distributed(_zero3_body, world_size=WORLD, args=(str(tmp_path),))


# ---- fp16: a step skipped for an overflow was not applied -------------------------------------------


def _overflow_body(ctx):
    engine = _engine(2, fp16={"enabled": True, "initial_scale_power": 8})
    for k in range(GAS):  # a clean window
        _micro_step(engine, ctx.rank, k)
    assert engine.was_step_applied() is True
    engine.module.poison = ctx.rank == 1  # one rank's gradients overflow: the step is skipped everywhere
    for k in range(GAS):
        _micro_step(engine, ctx.rank, 10 + k)
        assert engine.was_step_applied() is False, k
    assert engine.optimizer.overflow is True and engine.skipped_steps == 1
    engine.module.poison = False
    for k in range(GAS):
        _micro_step(engine, ctx.rank, 20 + k)
    assert engine.was_step_applied() is True
    assert math.isfinite(engine.tput_timer.avg_samples_per_sec())
    engine.destroy()


@pytest.mark.world_size(WORLD)
def test_was_step_applied_is_false_after_an_overflow():
    require_world_size(WORLD)
    run_distributed(_overflow_body, world_size=WORLD)
