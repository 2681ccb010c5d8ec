"""``deepspeed.initialize(training_data=, collate_fn=)`` (issue 41; DeepSpeed's getting-started
example trains from the loader it returns): the micro-batch size of the config, each rank its own
rows, the collate function applied, and training through the loader equal to one process on the
same global batches. Before, both arguments were refused."""

import pytest
import torch

from _harness.multiproc import require_world_size, run_distributed

WORLD = 2
ROWS, MICRO = 12, 3


def _dataset():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 2, generator=g))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _collate(rows):
    """Stacks the rows and tags the batch, so the test sees the function was used."""
    x = torch.stack([r[0] for r in rows])
    y = torch.stack([r[1] for r in rows])
    return {"x": x, "y": y, "collated": True}


def _body(ctx):
    # The served package itself, not serve_as_deepspeed(): the pool's worker processes are shared
    # with tests that imported transformers already.
    from deepcompile.integrations import deepspeed_api as deepspeed

    with pytest.raises(ValueError, match="collate_fn"):
        deepspeed.initialize(model=_model(), collate_fn=_collate, config={"train_micro_batch_size_per_gpu": 1})
    model = _model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "compile": {"backend": "eager"}}
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=_dataset(), collate_fn=_collate, config=config)
    batches = list(loader)
    assert len(loader) == ROWS // WORLD // MICRO == len(batches)
    assert all(b["collated"] and b["x"].shape == (MICRO, 6) for b in batches)
    # DeepSpeed's sampler: rank r gets rows r, r + world, ... (no shuffling by default).
    rows = torch.cat([b["x"] for b in batches])
    assert torch.equal(rows, _dataset().tensors[0][ctx.rank::WORLD])
    for b in batches:
        loss = torch.nn.functional.mse_loss(engine(b["x"]), b["y"])
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        trained = [p.detach().clone() for p in model.parameters()]

    # One process, the two ranks' micro-batches of each step together (equal sizes: the mean of
    # the ranks' means is the mean over all rows), plain SGD.
    x, y = _dataset().tensors
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(len(batches)):
        index = torch.cat([torch.arange(r, ROWS, WORLD)[step * MICRO:(step + 1) * MICRO] for r in range(WORLD)])
        loss = torch.nn.functional.mse_loss(reference(x[index]), y[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
    for got, want in zip(trained, reference.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)  # fp32, summation order only


@pytest.mark.world_size(WORLD)
def test_initialize_builds_the_training_data_loader():
    require_world_size(WORLD)
    run_distributed(_body, world_size=WORLD)
