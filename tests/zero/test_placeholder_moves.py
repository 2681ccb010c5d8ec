"""Moving or casting a ZeRO-3 model (``module.cpu()``, ``.to(dtype)``) keeps each placeholder one
element big (zero/placeholder_moves.py). Before, the conversion materialised every placeholder at
full size: Lightning's teardown put the whole model's bytes in host memory (issue 41)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import run_distributed
from deepcompile.zero import placeholder_moves
from deepcompile.zero.partition import make_placeholder


def test_a_cast_converts_placeholders_without_materialising_them_and_real_values_as_usual():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    real = model[1].weight  # stands for a parameter whose values are gathered (GatheredParameters)
    values = real.detach().clone()
    for i, p in enumerate(model.parameters()):
        if p is not real:
            p.data = make_placeholder(p.shape, p.dtype, p.device)
        p.ds_id = i
    placeholder_moves.acquire()
    try:
        model.to(torch.float64)
    finally:
        placeholder_moves.release()
    for p in model.parameters():
        assert p.dtype == torch.float64
    for p in (model[0].weight, model[0].bias, model[1].bias):
        assert placeholder_moves.is_placeholder(p.data) and p.untyped_storage().nbytes() == 8
        assert p.shape in (torch.Size([32, 64]), torch.Size([32]), torch.Size([8]))
        with pytest.raises(RuntimeError, match=r"\(ds_id \d\) is partitioned by ZeRO-3"):  # still no values to read
            p.data.sum()
    assert torch.equal(real.data, values.double())
    # Released: torch's own conversion again, which reads each placeholder (refused).
    with pytest.raises(RuntimeError, match="is partitioned by ZeRO-3"):
        model.to(torch.float32)


def _engine_body(ctx):
    import deepcompile

    def train(round_trip: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        engine = deepcompile.initialize(model, None, {"zero_optimization": {"stage": 3},
                                                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        losses = []
        try:
            g = torch.Generator().manual_seed(1 + ctx.rank)
            for step in range(2):
                x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if round_trip and step == 0:
                    model.to(torch.float64)  # what a teardown or a cast does between steps
                    sizes = {p.untyped_storage().nbytes() for p in model.parameters()}
                    assert sizes == {8}, f"placeholders materialised by the cast: storage bytes {sizes}"
                    model.to(torch.float32)
        finally:
            engine.destroy()
        return losses

    assert train(round_trip=True) == train(round_trip=False)


@pytest.mark.world_size(2)
def test_a_zero3_model_cast_between_steps_keeps_placeholders_small_and_trains_on():
    run_distributed(_engine_body, 2)
