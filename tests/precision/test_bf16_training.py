"""``bf16.enabled: true`` trains in bf16 whatever dtype the model was built in (issue 17, item 4).

The engine casts the parameters to bf16 before partitioning them (on the ``meta`` device, before
materialising, for a meta model): the module's parameters are bf16, so gathers and compute are
bf16, while the master weights each rank keeps (what ``Sharding.shards()`` exposes) and the
optimizer state are fp32, for ZeRO-1, 2 and 3. Checked by training:

* an fp32-built model and the same model built in bf16 train identically (bit for bit: after the
  cast the two are the same bf16 model with the same fp32 masters). The model has no floating
  buffers: those keep their dtype (as in DeepSpeed; rotary ``inv_freq`` would lose precision),
  while building in bf16 with ``.to(torch.bfloat16)`` rounds them too;
* a Llama built on ``meta`` in fp32 and initialised by ``init_fn`` trains identically to a
  CPU-built one whose parameters were cast to bf16 and then initialised by the same function
  from the same seed (the cast comes first: ``init_fn`` writes bf16 parameters in both).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model, make_optimizer
from test_sharded_init import LlamaLoss, hf_init

WORLD = single_world_size()
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
STEPS = 3


def _train(ctx, name, model, stage, init_fn=None):
    import deepcompile

    torch._dynamo.reset()
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64}, "bf16": {"enabled": True}}
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg, init_fn=init_fn,
                                    device=ctx.device)
    floating = [p for p in model.parameters() if p.is_floating_point()]
    assert floating and all(p.dtype == torch.bfloat16 for p in floating)  # what is gathered and computed
    if stage == 3:
        assert {sp.gather_dtype for sp in engine.sharding.params} == {torch.bfloat16}
    rank, n = ctx.rank, GLOBAL_BATCH // ctx.world_size
    losses = []
    for step in range(STEPS):
        a, b = batch(name, step, device=ctx.device, dtype=torch.bfloat16)
        loss = engine(a[rank * n:(rank + 1) * n], b[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().item())
    shards = list(engine.sharding.shards())
    assert shards and all(s.local.dtype == torch.float32 for s in shards)  # fp32 masters
    owned = [s for s in shards if s.end > s.start]
    for s in owned:
        state = engine.sharding.shard_optimizer_state(s.ds_id)
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    masters = {s.name: s.local.clone() for s in shards}
    state = engine.full_state_dict(all_ranks=True)
    engine.destroy()
    return losses, masters, state


def _assert_same(a, b):
    assert a[0] == b[0], (a[0], b[0])
    for got, want in ((a[1], b[1]), (a[2], b[2])):
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key


def _built_dtype_body(ctx, stage):
    from_fp32 = _train(ctx, "mlp", build_model("mlp", device=ctx.device), stage)
    from_bf16 = _train(ctx, "mlp", build_model("mlp", dtype=torch.bfloat16, device=ctx.device), stage)
    _assert_same(from_fp32, from_bf16)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_enabled_trains_an_fp32_built_model_as_a_bf16_built_one(stage):
    run_distributed(_built_dtype_body, WORLD, args=(stage,), timeout=300)


def _meta_body(ctx, stage):
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = LlamaLoss()
    assert meta.model.lm_head.weight.dtype == torch.float32
    from_meta = _train(ctx, "llama", meta, stage, init_fn=hf_init(meta))
    cpu = LlamaLoss().to(device=ctx.device)
    with torch.no_grad():
        for p in cpu.parameters():
            p.data = p.data.to(torch.bfloat16)
    torch.manual_seed(7)
    with torch.no_grad():
        for m in cpu.modules():
            hf_init(cpu)(m)
    from_cpu = _train(ctx, "llama", cpu, stage)
    _assert_same(from_meta, from_cpu)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_enabled_meta_model_trains_as_the_cpu_built_one(stage):
    run_distributed(_meta_body, WORLD, args=(stage,), timeout=300)
