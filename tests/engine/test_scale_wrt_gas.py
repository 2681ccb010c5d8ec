"""``engine.backward(loss, scale_wrt_gas=False)``: DeepSpeed's keyword, which Hugging Face Trainer
passes because it divides the loss by the accumulation steps itself.

With gradient_accumulation_steps 3 (not a power of two, where multiplying the division back out
would round), a run that divides each micro-step's loss by 3 and passes ``scale_wrt_gas=False``
must end with bitwise the parameters of a run that lets the engine divide: the engine computes
the same ``loss / 3`` either way. The caller divides with ``/`` rather than multiplying by
``1/3``, which rounds differently. fp16 checks that the loss scale still applies: a power of two,
so scaling before or after the division gives the same bits.

SGD, whose update is proportional to the gradient: a division skipped or done twice (gradients
3x or 1/3 of what they should be) changes every parameter.
"""

from __future__ import annotations

import pytest
import torch

from _harness.multiproc import run_distributed
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model, make_optimizer

WORLD = 2
GAS = 3
STEPS = 2


def _config(fp16: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD, "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": 2 if fp16 else 3, "reduce_bucket_size": 64},
            "fp16": {"enabled": fp16, "loss_scale": 1024.0}}


def _train(ctx, fp16: bool, caller_divides: bool):
    import deepcompile

    dtype = torch.float16 if fp16 else torch.float32
    model = build_model("mlp", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), "sgd_momentum"), _config(fp16),
                                    device=ctx.device)
    before = {k: v.clone() for k, v in engine.full_state_dict(all_ranks=True).items()}
    n = GLOBAL_BATCH // ctx.world_size
    for micro in range(STEPS * GAS):
        x, y = batch("mlp", micro, device=ctx.device, dtype=dtype)
        loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
        if caller_divides:
            engine.backward(loss / GAS, scale_wrt_gas=False)
        else:
            engine.backward(loss)
        engine.step()
    assert engine.global_steps == STEPS
    after = {k: v.clone() for k, v in engine.full_state_dict(all_ranks=True).items()}
    engine.destroy()
    assert all(not torch.equal(after[k], before[k]) for k in before), "a parameter did not train"
    return after


def _body(ctx, fp16: bool):
    engine_divides = _train(ctx, fp16, caller_divides=False)
    caller_divides = _train(ctx, fp16, caller_divides=True)
    for name, want in engine_divides.items():
        assert torch.equal(caller_divides[name], want), (
            f"{name}: backward(loss / {GAS}, scale_wrt_gas=False) trained differently from backward(loss), "
            f"max difference {(caller_divides[name].float() - want.float()).abs().max().item()}")


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32-zero3", "fp16-zero2"])
def test_caller_divided_loss_trains_bitwise_as_engine_divided(fp16):
    run_distributed(_body, WORLD, args=(fp16,), timeout=300)
