"""``engine.offload_states()`` / ``reload_states()`` between two phases (issue 41; OpenRLHF,
open-instruct and ms-swift move the policy's training state off the GPU while an inference engine
generates): every state kind's device storage empty while offloaded, training refused until the
reload, the same tensors holding the same values after it, and the run after the round trip equal
to one process that never offloaded. Before, the served engine had no such methods."""

import pytest
import torch

from _harness.multiproc import require_world_size, run_distributed

WORLD = 2
STEPS_BEFORE, STEPS_AFTER, MICRO, LR = 2, 2, 2, 1e-2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches():
    g = torch.Generator().manual_seed(5)
    steps = STEPS_BEFORE + STEPS_AFTER
    return torch.randn(steps, WORLD * MICRO, 6, generator=g), torch.randn(steps, WORLD * MICRO, 2, generator=g)


def _body(ctx, stage):
    # The served package itself, not serve_as_deepspeed(): the pool's worker processes are shared
    # with tests that imported transformers already.
    from deepcompile.integrations import deepspeed_api as deepspeed
    from deepcompile.integrations.deepspeed_api.runtime.zero.offload_config import (OffloadDeviceEnum,
                                                                                   OffloadStateTypeEnum)

    model = _model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}, "compile": {"backend": "eager"}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    xs, ys = (t.to(ctx.device) for t in _batches())
    mine = slice(ctx.rank * MICRO, (ctx.rank + 1) * MICRO)

    def train(step):
        loss = torch.nn.functional.mse_loss(engine(xs[step, mine]), ys[step, mine])
        engine.backward(loss)
        return loss

    for step in range(STEPS_BEFORE):
        train(step)
        engine.step()

    inner = engine.engine.basic_optimizer
    masters = [p for g in inner.param_groups for p in g["params"]]
    moments = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    lp = list(model.parameters()) if stage < 3 else []
    before = [t.detach().clone() for t in masters + moments + lp]

    with pytest.raises(ValueError, match="cpu only"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    # Only the optimizer's state: the masters stay.
    optimizer.offload_states(include=[OffloadStateTypeEnum.optim_states])
    assert all(t.untyped_storage().nbytes() == 0 for t in moments)
    assert all(t.untyped_storage().nbytes() > 0 for t in masters)
    optimizer.reload_states()
    # Everything.
    on_gpu = ctx.device.type == "cuda"
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in masters + moments + lp}
    held = sum(storages.values())  # flat buffers counted once
    allocated = torch.cuda.memory_allocated(ctx.device) if on_gpu else 0
    engine.offload_states()
    assert all(t.untyped_storage().nbytes() == 0 for t in masters + moments + lp)
    if on_gpu:  # the device memory itself is given back, not only the tensors emptied
        freed = allocated - torch.cuda.memory_allocated(ctx.device)
        assert freed >= held, (freed, held)
    with pytest.raises(RuntimeError, match="reload_states"):
        engine(xs[0, mine])
    with pytest.raises(RuntimeError, match="already offloaded"):
        engine.offload_states()
    engine.reload_states()
    for t, old in zip(masters + moments + lp, before):
        assert torch.equal(t, old)

    # A backward waiting for its step: its gradients are not moved, so the offload is refused.
    train(STEPS_BEFORE)
    with pytest.raises(RuntimeError, match="accumulation window"):
        engine.offload_states()
    engine.step()
    for step in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER):
        train(step)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        trained = [p.detach().cpu().clone() for p in model.parameters()]

    # One process on the same global batches, no offload.
    reference = _model()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    xs, ys = xs.cpu(), ys.cpu()
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        loss = torch.nn.functional.mse_loss(reference(xs[step]), ys[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
    for got, want in zip(trained, reference.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)  # fp32, summation order only


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_and_reload_states_between_phases(stage):
    require_world_size(WORLD)
    run_distributed(_body, world_size=WORLD, args=(stage,))
