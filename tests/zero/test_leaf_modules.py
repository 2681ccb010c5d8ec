"""Leaf modules: a mixture of experts whose router sends no token to some expert on one rank while
the other ranks use it, with the expert loop run eagerly. Without the leaf mark, the expert that
one rank skips is gathered (ZeRO-3) and reduced (all stages) by the others only, so the ranks'
collectives no longer pair up. With it, training matches single-process training on the same
global batch, at 2 and 3 ranks, for every stage and both backends.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _harness.multiproc import run_distributed, single_world_size, world_sizes, ws_id
from _harness.parity_cases import GLOBAL_BATCH, make_optimizer

TOL = dict(rtol=1e-5, atol=1e-6)  # the expert loop runs eagerly on both sides: fp32 reduction order only
INDUCTOR_TOL = dict(rtol=1e-4, atol=1e-5)  # the router and loss are compiled (fused sums)
N_EXPERTS = 3
# Expert of each row of the global batch. Rank 0 holds rows 0-5 (2 ranks) or 0-3 (3 ranks) and
# routes no token to expert 2; every other rank does.
ROUTES = [0, 1, 1, 0, 1, 0, 2, 0, 2, 1, 2, 2]


class ExpertLoop(nn.Module):
    """Experts as separate modules, each run only on the rows routed to it."""

    def __init__(self, disable_loop: bool):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 5) for _ in range(N_EXPERTS))
        self.disable_loop = disable_loop

    def forward(self, h, route, weights):
        if self.disable_loop:
            return self._loop_disabled(h, route, weights)
        torch._dynamo.graph_break()
        return self._loop(h, route, weights)

    @torch.compiler.disable
    def _loop_disabled(self, h, route, weights):
        return self._loop(h, route, weights)

    def _loop(self, h, route, weights):
        out = torch.zeros(h.shape[0], 5, dtype=h.dtype, device=h.device)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(h[rows]) * weights[rows, e : e + 1])
        return out


class OwnedExpertLoop(ExpertLoop):
    """The experts' weights as parameters of the leaf itself (as transformers' fused experts hold
    them), one per expert: the one rank 0 routes nothing to gets no gradient from autograd there,
    so only the leaf's own gather can give it one on every rank."""

    def __init__(self, disable_loop: bool):
        nn.Module.__init__(self)
        for e in range(N_EXPERTS):
            layer = nn.Linear(6, 5)
            setattr(self, f"weight{e}", layer.weight)
            setattr(self, f"bias{e}", layer.bias)
        self.experts = [functools.partial(self._expert, e) for e in range(N_EXPERTS)]
        self.disable_loop = disable_loop

    def _expert(self, e, h):
        return nn.functional.linear(h, getattr(self, f"weight{e}"), getattr(self, f"bias{e}"))


class RoutedMoE(nn.Module):
    def __init__(self, disable_loop: bool, loop=ExpertLoop):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.gate = nn.Linear(6, N_EXPERTS)
        self.moe = loop(disable_loop)

    def forward(self, x, route, y):
        h = torch.tanh(self.proj(x))
        weights = torch.sigmoid(self.gate(h))
        return ((self.moe(h, route, weights) - y) ** 2).mean()


def _model(disable_loop, device, loop=ExpertLoop):
    torch.manual_seed(4321)
    return RoutedMoE(disable_loop, loop).to(device)


def _batch(step, device):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    y = torch.randn(GLOBAL_BATCH, 5, generator=g)
    return x.to(device), torch.tensor(ROUTES, device=device), y.to(device)


def _body(ctx, stage, backend, disable_loop, steps=3, loop=ExpertLoop):
    import deepcompile

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model(disable_loop, ctx.device, loop)
    ref_opt = make_optimizer(reference.parameters())
    model = _model(disable_loop, ctx.device, loop)
    (leaf,) = deepcompile.set_leaf_modules(model, [loop])
    assert leaf is model.moe
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
    if backend is not None:
        engine.compile(backend=backend)
    n = GLOBAL_BATCH // world
    mine = slice(rank * n, (rank + 1) * n)
    for step in range(steps):
        x, route, y = _batch(step, ctx.device)
        if world > 1:  # the imbalance is real
            assert (route[mine] == N_EXPERTS - 1).any() == (rank != 0)
        loss = engine(x[mine], route[mine], y[mine])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        ref_loss = reference(x, route, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(total / world, ref_loss.detach(), **(INDUCTOR_TOL if backend == "inductor" else TOL))
    got = engine.full_state_dict(all_ranks=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value.cpu(), **(INDUCTOR_TOL if backend == "inductor" else TOL),
                                   msg=lambda m: f"{name}: {m}")
    if stage == 3:
        expert_weights = {f"moe.experts.{e}.weight" if loop is ExpertLoop else f"moe.weight{e}"
                          for e in range(N_EXPERTS)}
        assert expert_weights <= set(engine.eagerly_gathered_params())
    engine.destroy()


@pytest.mark.parametrize("world", world_sizes((2, 3)), ids=ws_id)
@pytest.mark.parametrize("stage", [3, 2, 1])
@pytest.mark.parametrize("disable_loop", [True, False], ids=["disabled_loop", "graph_break"])
def test_imbalanced_experts_in_an_eager_leaf(world, stage, disable_loop):
    run_distributed(_body, world, args=(stage, "eager", disable_loop), timeout=300)


@pytest.mark.world_size(single_world_size())
@pytest.mark.parametrize("stage", [3, 2])
def test_imbalanced_experts_owned_by_the_leaf(stage):
    """The leaf's own parameters are gathered and reduced by the leaf (ZeRO-3: not by the
    per-module eager hooks, which would gather them first and reduce only what autograd reached)."""
    run_distributed(_body, single_world_size(), args=(stage, "eager", True), kwargs={"loop": OwnedExpertLoop},
                    timeout=300)


@pytest.mark.world_size(single_world_size())
@pytest.mark.parametrize("stage", [3, 1])
def test_imbalanced_experts_in_an_eager_leaf_inductor(stage):
    run_distributed(_body, single_world_size(), args=(stage, "inductor", False), timeout=600)


def test_set_leaf_modules_rejects_what_it_cannot_honour():
    import deepcompile

    model = RoutedMoE(True)
    with pytest.raises(ValueError, match="no submodule of the model matches"):
        deepcompile.set_leaf_modules(model, [nn.Conv2d])
    with pytest.raises(TypeError, match="classes or instances"):
        deepcompile.set_leaf_modules(model, ["ExpertLoop"])
    deepcompile.set_leaf_modules(model, [model.moe])
    with pytest.raises(ValueError, match="lies inside leaf"):
        deepcompile.set_leaf_modules(model, [RoutedMoE])
    model.proj.weight.ds_id = 0  # what initialize leaves on partitioned parameters
    with pytest.raises(RuntimeError, match="before deepcompile.initialize"):
        deepcompile.set_leaf_modules(model, [ExpertLoop])
