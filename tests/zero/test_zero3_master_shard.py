"""ZeRO-3 keeps one shard per trainable parameter: the fp32 master copy is the gather source.

The engine registers each trainable parameter's fp32 master shard (the tensor the optimizer
updates) as the shard the runtime all-gathers from, with the parameter's dtype as gather dtype.
There is no second shard in the parameter's dtype: for a bf16 model a gather rounds the master to
bf16 on the way, for an fp32 model master and shard are one tensor. Frozen parameters keep a shard
in their own dtype and have no master. The numerics match the former copy-back (bf16 parameter =
bf16(master) after every step), checked exactly here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model, make_optimizer

WORLD = single_world_size()  # 2 (or DC_TEST_WORLD_SIZES), at most the GPU count
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
# "lora": frozen base weights (fc1.*, fc2.weight), trainable adapters and a trainable fc2.bias of
# 5 elements, which the threshold of 10 makes persistent.
CONFIG = {
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 10},
    "gradient_accumulation_steps": 1,
}


def _full_master(sp) -> torch.Tensor:
    """The full fp32 master weights of ``sp``: every rank's master shard, unpadded."""
    parts = [torch.empty_like(sp.master) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, sp.master.detach().contiguous())
    return torch.cat(parts)[: sp.numel].view(sp.shape)


def _check_params_are_rounded_masters(engine, trainable, dtype, what):
    full = engine.full_state_dict(all_ranks=True)
    for sp in trainable:
        want = _full_master(sp).to(dtype).cpu()
        got = full[sp.name]
        assert got.dtype == dtype, f"{what}: {sp.name} gathered as {got.dtype}, parameter dtype is {dtype}"
        assert torch.equal(got, want), f"{what}: {sp.name} is not {dtype}(master)\n{got}\n{want}"


def _body_master_is_gather_source(ctx, dtype, backend):
    import deepcompile
    from deepcompile import runtime

    torch._dynamo.reset()
    model = build_model("lora", dtype=dtype, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), CONFIG)
    if backend is not None:
        engine.compile(backend=backend)
    sharding = engine.sharding
    trainable = [sp for sp in sharding.params if sp.trainable]
    frozen = [sp for sp in sharding.params if not sp.trainable]
    assert trainable and frozen

    # One fp32 tensor per trainable parameter: the optimizer's param, the engine's shard and the
    # runtime's registered gather source share one storage.
    optimized = [p for group in engine.optimizer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(sp.master) for sp in trainable}
    for sp in trainable:
        registered = runtime.registered_shard(sp.ds_id)
        assert sp.shard.dtype == torch.float32 and registered.dtype == torch.float32, sp.name
        assert registered.data_ptr() == sp.master.data_ptr() == sp.shard.data_ptr(), (
            f"{sp.name}: the registered shard is not the optimizer's master tensor"
        )
        assert registered.untyped_storage().data_ptr() == sp.master.untyped_storage().data_ptr()
        assert sp.master.untyped_storage().nbytes() == 4 * sp.ppr, f"{sp.name}: master is not a (ppr,) fp32 shard"
        assert sp.gather_dtype == dtype and runtime.gather_dtype(sp.ds_id) == dtype, sp.name
    for sp in frozen:
        assert sp.master is None, f"frozen {sp.name} has a master copy"
        registered = runtime.registered_shard(sp.ds_id)
        assert registered.dtype == dtype and registered.data_ptr() == sp.shard.data_ptr(), sp.name
        assert runtime.gather_dtype(sp.ds_id) == dtype

    persistent = [sp for sp in trainable if sp.persistent]
    assert persistent, "the test needs a trainable persistent parameter"
    initial = {sp.name: _full_master(sp).clone() for sp in trainable}

    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world
    for step in range(3):
        a, b = batch("lora", step, device=ctx.device, dtype=dtype)
        loss = engine(a[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n])
        # Persistent parameters stay gathered after the forward, in the parameter's dtype.
        for sp in persistent:
            buf = runtime.gathered_buffer(sp.ds_id)
            assert buf is not None and buf.dtype == dtype, (
                f"step {step}: persistent {sp.name} gathered as {None if buf is None else buf.dtype}"
            )
        engine.backward(loss)
        engine.step()
        for sp in trainable:
            assert runtime.registered_shard(sp.ds_id).data_ptr() == sp.master.data_ptr(), sp.name
        _check_params_are_rounded_masters(engine, trainable, dtype, f"after step {step}")
    moved = [sp.name for sp in trainable if not torch.equal(_full_master(sp), initial[sp.name])]
    assert moved, "the optimizer did not change any master weight"

    # An in-place change of the master alone (no copy anywhere) is what the next gather returns.
    with torch.no_grad():
        for sp in trainable:
            sp.master.add_(1.0 / 3.0)
    runtime.invalidate_all_gathered()
    _check_params_are_rounded_masters(engine, trainable, dtype, "after an in-place master update")
    engine.destroy()


@pytest.mark.parametrize(
    "dtype,backend",
    [(torch.bfloat16, None), (torch.bfloat16, "eager"), (torch.float32, "eager")],
    ids=["bf16-eager_frames", "bf16-compiled", "fp32-compiled"],
)
def test_master_shard_is_the_gather_source(dtype, backend):
    run_distributed(_body_master_is_gather_source, WORLD, args=(dtype, backend))
