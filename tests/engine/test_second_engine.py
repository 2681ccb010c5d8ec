"""Two training engines in one process: the runtime is one per process (issue 51 will make it one
per engine), and a second ``initialize`` replaced it silently, so the first engine then trained on
the second one's parameters (its loss equal to the second's, its ``full_state_dict`` the second's
weights). Now, on two gloo ranks: the first engine's forward, backward, step and
``full_state_dict`` raise an error that says why; destroying the first leaves the second's
runtime alone, and the second trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import run_distributed

REPLACED = "replaced the runtime this engine registered"


def _engine(seed: int):
    import deepcompile

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    return model, deepcompile.initialize(model, None, {"zero_optimization": {"stage": 3},
                                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def _train_step(engine, x):
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _body(ctx):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
    model_a, a = _engine(0)
    _train_step(a, x)
    model_b, b = _engine(1)
    try:
        for use in (lambda: a(x), lambda: a.backward(torch.zeros(())), a.step, a.full_state_dict):
            with pytest.raises(RuntimeError, match=REPLACED):
                use()
        a.destroy()  # leaves the second engine's runtime alone
        before = b.full_state_dict(all_ranks=True)
        _train_step(b, x)
        after = b.full_state_dict(all_ranks=True)
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        b.destroy()


@pytest.mark.world_size(2)
def test_an_engine_whose_runtime_was_replaced_refuses_to_run():
    run_distributed(_body, 2, timeout=300)
