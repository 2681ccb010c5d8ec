"""Compiling layer by layer (FSDP2 style) with the "deepcompile" backend.

Dynamo captures identical layers once (same code, parameters passed as inputs) and calls the
compiled graph with each layer's parameters. Each layer must then gather its own parameters and
reduce into its own partitions, while the graph is compiled only once: it takes its instance (the
layer's ds ids) as data (compiler/graph_instances.py). This test trains identical blocks, each
compiled on its own, against single-process training and checks that the blocks share compiled
graphs, each block running as an instance of its own.
"""

from __future__ import annotations

import copy
import functools

import pytest

import torch
import torch.distributed as dist
import torch.nn as nn

from _harness.multiproc import run_distributed, single_world_size

pytestmark = pytest.mark.world_size(single_world_size())  # the world size in every test id (conftest.py)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _body(ctx, inner="eager"):
    import deepcompile

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = Net().to(ctx.device)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "compile": {"prefetch": False, "selective_gather": False}}
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    for block in engine.module.blocks:
        block.compile(backend="deepcompile", options={"inner": inner})
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(3):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step)).to(ctx.device)
        loss = engine(x[rank * 4:(rank + 1) * 4])
        engine.backward(loss)
        engine.step()
        ref_loss = reference(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total.item() / world, ref_loss.item(), rtol=1e-5, atol=1e-6)
    backend = engine.compiled_module.backend_for(inner)
    # Block 0's input does not require grad, the others' does: Dynamo captures two graphs.
    assert len(backend.graphs) == 2, [r.graph_id for r in backend.graphs]
    assert len(backend.instances) == 3, "each block must run as an instance of its own"
    assert len({tuple(i.slot_ids) for i in backend.instances.values()}) == 3
    state = engine.full_state_dict(all_ranks=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value.cpu(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    engine.destroy()
    torch._dynamo.reset()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_identical_layers_compiled_one_by_one_train_correctly(inner):
    # 2 (or DC_TEST_WORLD_SIZES), at most the GPU count
    run_distributed(functools.partial(_body, inner=inner), world_size=single_world_size())
