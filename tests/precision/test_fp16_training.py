"""``fp16.enabled: true`` with DeepSpeed's loss scaling on ZeRO-1/2/3 (deepcompile/precision/).

The engine casts the parameters to fp16, multiplies the loss by the loss scale in
``engine.backward``, and at the step divides the scale out of the fp32 gradient partitions before
clipping and updating the fp32 masters. A non-finite global gradient norm (an inf or nan gradient
on any rank) skips the step on every rank, as DeepSpeed does: parameters and optimizer state
unchanged, ``engine.optimizer.overflow`` true, ``engine.skipped_steps`` counted, the LR schedule
not advanced, and the scale lowered (loss_scaler.py's rules, unit-tested in test_loss_scaler.py).

The single-process reference does what fp16 training means: an fp16 model, the loss times the
same scale, fp32 gradients divided by it, fp32 masters updated by the same optimizer and copied
back to fp16. It trains with SGD (momentum), whose update is proportional to the gradient: under
Adam, which divides the gradient's scale out, a scale left in the gradients would go unseen.

Tolerance (parity): the ranks compute their half-batch gradients in fp16 and sum them in fp32,
the reference computes the full batch in fp16: the gradients differ by fp16 rounding (about 1e-3
relative). Over a few SGD steps of lr 0.05 that moves the fp32 masters by well under 1e-4; the
parameters compared are fp16, whose rounding of such masters may differ by one unit in the last
place (at most 4.9e-4 for |p| < 1). atol 1e-3 covers both, while a gradient off by a factor of two
(an unaveraged or doubled reduction, a scale divided out twice or not at all) moves a parameter by
at least a few 1e-3 in the first steps and a scale left in it by orders of magnitude more.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model
from _harness.poison_grad import PoisonGrad

WORLD = single_world_size()
FP16_RTOL, FP16_ATOL = 2e-3, 1e-3
LR = 0.05


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def decaying(step: int) -> float:
    return 1.0 / (1 + step)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, decaying)


def engine_config(stage: int, fp16: dict, gas: int = 1, clip: float = 0.0) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64}, "gradient_clipping": clip,
            "steps_per_print": 1, "fp16": {"enabled": True, **fp16}}


def poison_on(model: nn.Module, when) -> None:
    """fc1's output gradient gets an inf whenever ``when()`` is true: fc1's gradients overflow
    on this rank only."""
    model.fc1.register_forward_hook(lambda m, i, out: PoisonGrad.apply(out) if when() else out)


# ---- the single-process reference -----------------------------------------------------------------


def reference(steps: int, scales, skipped=(), gas: int = 1, clip: float = 0.0):
    """fp16 training of the whole batch in one process: per optimizer step, the scale its loss is
    multiplied by (``scales``) and whether it is skipped; returns the fp16 parameters after each
    optimizer step and the norms of the applied steps' unscaled gradients."""
    model = build_model("mlp")
    params = list(model.parameters())
    masters = [p.detach().clone() for p in params]
    model.half()
    opt = make_optimizer(masters)
    sched = make_scheduler(opt)
    history, norms = [], []
    for k in range(steps):
        scale = scales[k]
        acc = [torch.zeros_like(m) for m in masters]
        for micro in range(gas):
            loss = model(*batch("mlp", k * gas + micro, dtype=torch.float16))
            (loss * scale / gas).backward()
            for g, p in zip(acc, params):
                g += p.grad.float()
                p.grad = None
        if k in skipped:
            history.append({n: p.detach().clone() for n, p in model.named_parameters()})
            norms.append(None)
            continue
        grads = [g / scale for g in acc]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        norms.append(float(norm))
        if clip > 0:
            coef = (clip / (norm + 1e-6)).clamp(max=1.0)
            grads = [g * coef for g in grads]
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        sched.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history, norms


def _train(ctx, engine, steps: int, gas: int = 1, after_step=None):
    """Every rank trains on its slice of each global batch; ``after_step(k)`` after each optimizer step."""
    rank = ctx.rank
    for k in range(steps):
        for micro in range(gas):
            a, b = batch("mlp", k * gas + micro, device=ctx.device, dtype=torch.float16)
            n = GLOBAL_BATCH // ctx.world_size
            engine.backward(engine(a[rank * n:(rank + 1) * n], b[rank * n:(rank + 1) * n]))
            engine.step()
        if after_step is not None:
            after_step(k)


def _params(engine):
    return {k: v.clone() for k, v in engine.full_state_dict(all_ranks=True).items()}


def _assert_close(got, want, what):
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=FP16_RTOL, atol=FP16_ATOL,
                                   msg=lambda m: f"{what}, {name}: {m}")


# ---- parity with a static scale ---------------------------------------------------------------------


def _parity_body(ctx, stage, compiled, gas, clip):
    import deepcompile

    torch._dynamo.reset()
    steps, scale = 4, 1024.0
    model = build_model("mlp", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()),
                                    engine_config(stage, {"loss_scale": scale}, gas=gas, clip=clip),
                                    lr_scheduler=make_scheduler, device=ctx.device)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert all(s.local.dtype == torch.float32 for s in engine.sharding.shards())  # fp32 masters
    if compiled:
        engine.compile(backend="eager")
    want, want_norms = reference(steps, [scale] * steps, gas=gas, clip=clip)
    if clip > 0:
        assert all(n > clip for n in want_norms), want_norms  # the clipping binds at every step

    def check(k):
        assert engine.optimizer.overflow is False and engine.skipped_steps == 0
        assert engine.optimizer.cur_scale == scale
        norm = engine.get_global_grad_norm()
        assert math.isclose(norm, want_norms[k], rel_tol=2e-3), (k, norm, want_norms[k])
        _assert_close(_params(engine), want[k], f"step {k}")

    _train(ctx, engine, steps, gas=gas, after_step=check)
    assert engine.lr_scheduler.last_epoch == steps
    if ctx.rank == 0:
        assert engine.step_report.last_values["loss_scale"] == scale
        assert "loss scale 1024" in engine.step_report.last_line
    engine.destroy()


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("stage,compiled,gas,clip", [
    (1, False, 1, 0.0), (2, False, 2, 0.05), (3, False, 1, 0.05), (3, True, 2, 0.0),
], ids=["zero1", "zero2-accum-clip", "zero3-clip", "zero3-compiled-accum"])
def test_fp16_static_scale_matches_single_process_fp16(stage, compiled, gas, clip):
    run_distributed(_parity_body, WORLD, args=(stage, compiled, gas, clip), timeout=300)


# ---- an overflow on one rank ------------------------------------------------------------------------


def _overflow_body(ctx, stage, hysteresis, poisoned, scales, checkpoint_dir):
    """Steps ``poisoned`` overflow on the last rank; ``scales``: the scale each step's loss is
    multiplied by, as DeepSpeed moves it."""
    import deepcompile

    torch._dynamo.reset()
    steps, poisoned = len(scales), set(poisoned)
    model = build_model("mlp", device=ctx.device)
    fp16 = {"loss_scale": 0, "initial_scale_power": 8, "hysteresis": hysteresis, "loss_scale_window": 1000}
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), engine_config(stage, fp16),
                                    lr_scheduler=make_scheduler, device=ctx.device)
    current = {"step": 0}
    if ctx.rank == ctx.world_size - 1:  # only the last rank's gradients overflow
        poison_on(model, lambda: current["step"] in poisoned)
    want, _ = reference(steps, scales, skipped=poisoned)
    before = {"params": _params(engine)}

    def check(k):
        skipped = k in poisoned
        assert engine.optimizer.overflow is skipped, k
        assert engine.skipped_steps == sum(1 for j in poisoned if j <= k)
        assert engine.global_steps == k + 1  # a skipped step still counts, as in DeepSpeed
        assert engine.lr_scheduler.last_epoch == k + 1 - engine.skipped_steps  # the schedule does not advance
        assert engine.loss_scaler.loss_scale == engine.optimizer.cur_scale == (scales[k + 1] if k + 1 < steps
                                                                               else scales[k])
        if ctx.rank == 0:
            assert engine.step_report.last_values["loss_scale"] == scales[k]
        now = _params(engine)
        if skipped:
            assert not math.isfinite(engine.get_global_grad_norm())
            for name, value in before["params"].items():
                assert torch.equal(now[name], value), f"step {k} was skipped but {name} changed"
        # Every rank holds the same parameters, bit for bit.
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, {n: t.cpu() for n, t in now.items()})
        for other in everyone[1:]:
            for name in now:
                assert torch.equal(other[name], everyone[0][name]), f"step {k}: ranks differ on {name}"
        _assert_close(now, want[k], f"step {k}")
        before["params"] = now
        current["step"] = k + 1

    _train(ctx, engine, steps, after_step=check)
    if checkpoint_dir is None:
        engine.destroy()
        return
    # The scale and its counters survive a checkpoint: a fresh engine starts at 256 and loads the
    # lowered one.
    saved = engine.loss_scaler.state_dict()
    engine.save_checkpoint(checkpoint_dir)
    engine.destroy()
    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    resumed = deepcompile.initialize(model, make_optimizer(model.parameters()), engine_config(stage, fp16),
                                     lr_scheduler=make_scheduler, device=ctx.device)
    assert resumed.loss_scaler.loss_scale == 256.0
    resumed.load_checkpoint(checkpoint_dir)
    assert resumed.loss_scaler.state_dict() == saved and resumed.loss_scaler.loss_scale == scales[-1] < 256.0
    assert resumed.optimizer.cur_scale == scales[-1] and resumed.optimizer.overflow is False
    assert resumed.skipped_steps == len(poisoned)
    resumed.destroy()


# (stage, hysteresis, poisoned steps, the scale of each step)
OVERFLOWS = {
    "zero1": (1, 1, (1,), (256.0, 256.0, 128.0, 128.0, 128.0)),
    "zero2": (2, 1, (1,), (256.0, 256.0, 128.0, 128.0, 128.0)),
    "zero3": (3, 1, (1,), (256.0, 256.0, 128.0, 128.0, 128.0)),
    # Hysteresis 2: the first overflow is tolerated, the second in a row halves.
    "zero3-hysteresis2": (3, 2, (1, 2), (256.0, 256.0, 256.0, 128.0, 128.0)),
    # The first steps overflow before any optimizer state exists (common with the default 2**16).
    "zero2-first-steps": (2, 1, (0, 1), (256.0, 128.0, 64.0, 64.0)),
}


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("case", sorted(OVERFLOWS))
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(case):
    run_distributed(_overflow_body, WORLD, args=(*OVERFLOWS[case], None), timeout=300)


@pytest.mark.world_size(WORLD)
def test_fp16_checkpoint_saves_and_restores_the_loss_scale(tmp_path):
    run_distributed(_overflow_body, WORLD, args=(*OVERFLOWS["zero2"], str(tmp_path / "ckpt")), timeout=300)
