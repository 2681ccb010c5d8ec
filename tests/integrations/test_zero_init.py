"""The served ``deepspeed.zero.Init`` on two gloo ranks, without transformers: what a model built
inside it holds before ``deepspeed.initialize`` and what the engine ends with
(deepcompile/integrations/deepspeed_api/zero_init.py).

The ranks seed their generators differently, so a value that is not rank 0's shows up.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import require_world_size, run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _body(ctx):
    import torch.distributed as dist

    from deepcompile.integrations import deepspeed_api
    from deepcompile.integrations.deepspeed_api.zero import GatheredParameters, Init
    from deepcompile.integrations.deepspeed_api.zero_init import defer, held_elements
    from deepcompile.integrations.deepspeed_api.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(100)
    reference = _build()  # rank 0's values (its seed below): what every rank must end with
    torch.manual_seed(100 + ctx.rank)
    with Init():
        model = _build()

    # Before initialize: placeholders owning one element, each rank holding ceil(numel / 2).
    assert held_elements(model) == {n: -(-p.numel() // 2) for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        assert p.untyped_storage().nbytes() == p.element_size(), name
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.ds_shape == p.shape, name
    weight = model[0].weight
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            weight.add_(1.0)  # outside a gathered block a write cannot land silently

    # Gathered: rank 0's constructor values on every rank; without modifier_rank changes vanish.
    with GatheredParameters([weight]):
        assert weight.ds_status is ZeroParamStatus.AVAILABLE
        assert torch.equal(weight.data, reference[0].weight.data)
        with torch.no_grad():
            weight.mul_(0.0)
    with GatheredParameters([weight], modifier_rank=0):
        assert torch.equal(weight.data, reference[0].weight.data)
        with torch.no_grad():
            weight.fill_(1.0 + ctx.rank)  # only rank 0's write is kept
    with torch.no_grad():
        reference[0].weight.fill_(1.0)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed_api.initialize(model=model, optimizer=optimizer, config=CONFIG)
    got = engine.engine.full_state_dict(all_ranks=True)
    for name, want in reference.state_dict().items():
        assert torch.equal(got[name].cpu(), want), name
    engine.destroy()

    # A parameter that never got a value is refused at initialize, by name, on every rank.
    with Init():
        model = _build()
    defer(model[2].bias, None, src=None)
    with pytest.raises(ValueError, match=r"2\.bias"):
        deepspeed_api.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CONFIG)
    dist.barrier()


@pytest.mark.world_size(2)
def test_zero_init_keeps_slices_of_rank0_values_until_initialize():
    require_world_size(2)
    run_distributed(_body, world_size=2)
