"""The Sharding interface's accessors of sharded state (zero/sharding.py), on every stage.

Two ranks (gloo on CPU; under DC_TEST_DEVICE=cuda one per GPU, at most two): the shards of each
rank together tile every parameter exactly, hold their values, line up with their optimizer
state, and writing them changes the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model, make_optimizer

WORLD = single_world_size()  # 2 (or DC_TEST_WORLD_SIZES), at most the GPU count
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
TOL = dict(rtol=1e-5, atol=1e-6)


def _all_ranks(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _assemble(pieces_per_rank, numel_of):
    """Full flat tensors from every rank's ``(ds_id, start, end, values)`` pieces; checks that the
    pieces tile each parameter exactly once."""
    full, covered = {}, {}
    for pieces in pieces_per_rank:
        for ds_id, start, end, values in pieces:
            flat = full.setdefault(ds_id, torch.full((numel_of[ds_id],), float("nan")))
            mask = covered.setdefault(ds_id, torch.zeros(numel_of[ds_id], dtype=torch.int32))
            flat[start:end] = values
            mask[start:end] += 1
    for ds_id, mask in covered.items():
        assert bool((mask == 1).all()), f"ds id {ds_id}: the ranks' ranges do not tile the parameter once"
    return full


def _train_one_step(engine, name, ctx):
    n = GLOBAL_BATCH // ctx.world_size
    x, y = batch(name, 0, device=ctx.device)
    engine.backward(engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n]))
    engine.step()


def _reference_state(name, ctx):
    """Single-process AdamW after one step on the whole batch: parameters and exp_avg by name."""
    model = build_model(name, device=ctx.device)
    opt = make_optimizer(model.parameters())
    model(*batch(name, 0, device=ctx.device)).backward()
    opt.step()
    exp_avg = {}
    for pname, p in model.named_parameters():
        if p in opt.state:
            exp_avg[pname] = opt.state[p]["exp_avg"].detach().reshape(-1).cpu()
    return {k: v.detach().reshape(-1).cpu() for k, v in model.named_parameters()}, exp_avg


def _accessors_body(ctx, stage, name):
    import deepcompile

    torch._dynamo.reset()
    model = build_model(name, device=ctx.device)
    initial = {k: v.detach().reshape(-1).cpu().clone() for k, v in model.named_parameters()}
    trainable = {k for k, v in model.named_parameters() if v.requires_grad}
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": stage}})
    sharding = engine.sharding
    shards = list(sharding.shards())

    # Every rank lists the same parameters, in ds id order; frozen ones only where partitioned.
    ids = [s.ds_id for s in shards]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(r == [(s.ds_id, s.name) for s in shards] for r in _all_ranks([(s.ds_id, s.name) for s in shards]))
    assert sharding.param_names() == {s.ds_id: s.name for s in shards}
    listed = {s.name for s in shards}
    assert listed == (set(initial) if stage == 3 else trainable), listed
    numel_of = {s.ds_id: s.numel for s in shards}
    for s in shards:
        assert s.numel == initial[s.name].numel() and s.local.dim() == 1
        assert s.local.numel() == s.end - s.start and 0 <= s.start <= s.end <= s.numel
        if s.name in trainable:
            assert s.local.dtype == torch.float32, "the local shard of a trainable parameter is its fp32 master"

    # The pieces hold the parameters' values and tile them exactly.
    full = _assemble(_all_ranks([(s.ds_id, s.start, s.end, s.local.cpu().clone()) for s in shards]), numel_of)
    for s in shards:
        torch.testing.assert_close(full[s.ds_id], initial[s.name].float(), **TOL)

    # No optimizer state before the first step; afterwards it lines up with the shard.
    assert all(sharding.shard_optimizer_state(s.ds_id) == {} for s in shards)
    _train_one_step(engine, name, ctx)
    ref_params, ref_exp_avg = _reference_state(name, ctx)
    pieces = []
    for s in shards:
        state = sharding.shard_optimizer_state(s.ds_id)
        if s.name not in trainable:
            assert state == {}
            continue
        assert set(state) >= {"exp_avg", "exp_avg_sq", "step"}, sorted(state)
        assert state["exp_avg"].shape == s.local.shape and state["exp_avg_sq"].shape == s.local.shape
        pieces.append((s.ds_id, s.start, s.end, state["exp_avg"].cpu().clone()))
    exp_avg = _assemble(_all_ranks(pieces), {i: n for i, n in numel_of.items() if any(p[0] == i for p in pieces)})
    by_name = {s.ds_id: s.name for s in shards}
    for ds_id, values in exp_avg.items():
        torch.testing.assert_close(values, ref_exp_avg[by_name[ds_id]], **TOL)
    trained = _assemble(_all_ranks([(s.ds_id, s.start, s.end, s.local.cpu().clone()) for s in shards]), numel_of)
    for ds_id, values in trained.items():
        torch.testing.assert_close(values, ref_params[by_name[ds_id]].float(), **TOL)

    # Optimizer state is written through its views.
    for s in shards:
        state = sharding.shard_optimizer_state(s.ds_id)
        if "exp_avg" in state:
            state["exp_avg"].fill_(float(s.ds_id))
    for s in shards:
        state = sharding.shard_optimizer_state(s.ds_id)
        if "exp_avg" in state:
            assert bool((state["exp_avg"] == float(s.ds_id)).all())

    # Writing the local shards and syncing changes the model on every rank.
    with torch.no_grad():
        for s in shards:
            s.local.copy_(torch.arange(s.start, s.end, dtype=s.local.dtype, device=s.local.device) / 100 + s.ds_id)
    sharding.sync_params_from_shards()
    state = engine.full_state_dict(all_ranks=True)
    for s in shards:
        expected = (torch.arange(s.numel, dtype=torch.float32) / 100 + s.ds_id).to(state[s.name].dtype)
        torch.testing.assert_close(state[s.name].reshape(-1), expected, **TOL)
    # full_params: each listed parameter whole, in its dtype, on rank 0 only; full_state_dict()
    # without all_ranks likewise ({} on the other ranks). Same values as the all-ranks gather.
    for s, full in sharding.full_params():
        if ctx.rank == 0:
            assert full.dtype == state[s.name].dtype and full.shape == s.shape
            assert torch.equal(full.cpu(), state[s.name]), s.name
        else:
            assert full is None
    on_rank0 = engine.full_state_dict()
    if ctx.rank == 0:
        assert on_rank0.keys() == state.keys() and all(torch.equal(on_rank0[k], state[k]) for k in state)
    else:
        assert on_rank0 == {}
    # ... and what the next forward computes with (the gathered or replicated values).
    x, y = batch(name, 1, device=ctx.device)
    got = engine(x, y)
    reference = build_model(name, device=ctx.device)
    reference.load_state_dict(state)
    torch.testing.assert_close(got.detach(), reference(x, y).detach(), **TOL)
    engine.destroy()


@pytest.mark.parametrize("name", ["mlp", "lora"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shards_tile_parameters_line_up_with_optimizer_state_and_write_back(stage, name):
    run_distributed(_accessors_body, world_size=WORLD, args=(stage, name))


def _reset_optimizer_state_body(ctx, stage, name):
    import deepcompile

    torch._dynamo.reset()
    model = build_model(name, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": stage}})
    sharding = engine.sharding
    shards = list(sharding.shards())
    _train_one_step(engine, name, ctx)
    saved = {s.ds_id: {k: v.clone() for k, v in sharding.shard_optimizer_state(s.ds_id).items()} for s in shards}
    held = [s.ds_id for s in shards if saved[s.ds_id]]
    assert held, "no parameter has optimizer state after a step"

    # Fresh state: per-element keys zero-filled and lined up with the shard, scalars as given.
    sharding.reset_optimizer_state({
        ds_id: {k: (None if v.dim() > 0 else v) for k, v in saved[ds_id].items()} for ds_id in held
    })
    for s in shards:
        state = sharding.shard_optimizer_state(s.ds_id)
        assert state.keys() == saved[s.ds_id].keys(), (s.name, sorted(state), sorted(saved[s.ds_id]))
        for key, value in state.items():
            if value.dim() > 0:
                assert value.shape == s.local.shape and not value.any(), f"{s.name}.{key} is not a zeroed view"
            else:
                assert torch.equal(value, saved[s.ds_id][key])
    # Written through the views, it is the state the next step uses: step 2 matches single-process
    # AdamW over two steps.
    for s in shards:
        for key, value in sharding.shard_optimizer_state(s.ds_id).items():
            if value.dim() > 0:
                value.copy_(saved[s.ds_id][key])
    n = GLOBAL_BATCH // ctx.world_size
    x, y = batch(name, 1, device=ctx.device)
    engine.backward(engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n]))
    engine.step()
    reference = build_model(name, device=ctx.device)
    opt = make_optimizer(reference.parameters())
    for step in range(2):
        reference(*batch(name, step, device=ctx.device)).backward()
        opt.step()
        opt.zero_grad()
    state = engine.full_state_dict(all_ranks=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value.detach().cpu(), **TOL, msg=lambda m: f"{key}: {m}")

    # Scalars: one per parameter on ZeRO-3; on ZeRO-1/2 one per param group, the largest given.
    steps = {ds_id: torch.tensor(float(3 + i)) for i, ds_id in enumerate(held)}
    sharding.reset_optimizer_state({ds_id: {"exp_avg": None, "step": steps[ds_id]} for ds_id in held})
    for ds_id in held:
        got = sharding.shard_optimizer_state(ds_id)["step"]
        assert float(got) == (float(steps[ds_id]) if stage == 3 else 2.0 + len(held)), (ds_id, got)
    # Parameters not named get no state.
    sharding.reset_optimizer_state({})
    assert all(sharding.shard_optimizer_state(s.ds_id) == {} for s in shards)
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reset_optimizer_state_gives_fresh_views_that_the_next_step_uses(stage):
    run_distributed(_reset_optimizer_state_body, world_size=WORLD, args=(stage, "mlp"))


class _CopyAccess:
    """A ``StateAccess`` (zero/sharding.py) keeping its own copy of chosen storages, as offload
    keeps host copies: what the stage hands out must be views of the copy, never of the original."""

    def __init__(self):
        from deepcompile import compat

        self.storage_id = compat.storage_id
        self.copies = {}
        self.replaced = []

    def keep(self, t):
        self.copies[self.storage_id(t)] = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8).copy_(
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu())

    def locate(self, t):
        copy = self.copies.get(self.storage_id(t))
        return t if copy is None else copy.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def state_replaced(self, ds_ids):
        self.replaced.append(sorted(ds_ids))


def _state_access_body(ctx, stage):
    import deepcompile

    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": stage}})
    sharding = engine.sharding
    _train_one_step(engine, "mlp", ctx)
    shards = list(sharding.shards())
    access = _CopyAccess()
    for s in shards:
        if s.local.numel():
            access.keep(s.local)
            for value in sharding.shard_optimizer_state(s.ds_id).values():
                if value.dim() > 0:
                    access.keep(value)
    sharding.state_access = access
    try:
        copies = {p.untyped_storage().data_ptr() for p in access.copies.values()}
        for s, before in zip(sharding.shards(), shards):
            assert torch.equal(s.local.cpu(), before.local.cpu()), s.name  # the copies live on the host
            if s.local.numel():
                assert s.local.untyped_storage().data_ptr() in copies, s.name
            for key, value in sharding.shard_optimizer_state(s.ds_id).items():
                if value.dim() > 0 and value.numel():
                    assert value.untyped_storage().data_ptr() in copies, (s.name, key)
        # Values written into the copy are what the model computes with after the sync (ZeRO-1/2
        # gather the masters from it; ZeRO-3 gathers from the registered shard, which the copy
        # stands for only under offload, so only ZeRO-1/2's module is checked here).
        for s in sharding.shards():
            s.local.fill_(0.5)
        sharding.sync_params_from_shards()
        if stage != 3:
            for s in shards:
                assert bool((model.get_parameter(s.name) == 0.5).all()), s.name
        else:
            # full_params reads the shards through the access too: rank 0 gets the written values.
            for s, full in sharding.full_params():
                if full is not None:
                    assert bool((full == 0.5).all()), s.name
        # Fresh optimizer state is announced: per parameter on ZeRO-3, per param group on ZeRO-1/2.
        held = [s.ds_id for s in shards if sharding.shard_optimizer_state(s.ds_id)]
        sharding.reset_optimizer_state({ds_id: {"exp_avg": None} for ds_id in held})
        announced = sorted(i for ids in access.replaced for i in ids)
        if stage == 3:
            assert access.replaced == [[i] for i in held], access.replaced
        else:
            assert announced == sorted(i for g in sharding.groups for i in g.ds_ids), access.replaced
    finally:
        sharding.state_access = None
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_access_is_where_stages_read_and_write_sharded_state(stage):
    run_distributed(_state_access_body, world_size=WORLD, args=(stage,))
