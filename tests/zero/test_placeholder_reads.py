"""A ZeRO-3 parameter read outside the engine's forward fails loudly (issue 41).

A partitioned parameter's ``.data`` is a placeholder of the full shape over one element
(zero/partition.py). It used to be NaN: ``weight.sum()``, ``x @ weight.T`` or a saved state dict
outside ``GatheredParameters`` silently gave NaN. DeepSpeed's empty placeholders fail only where a
shape does not fit and broadcast silently where it does. Now the placeholder's storage refuses
every read with an error that names the parameter and says how to get its values, while its
metadata (shape, dtype, device) stays what Dynamo traces. Checked on two gloo ranks: reads of an
engine's parameters between steps; a gathered block reads the real values and the refusal comes
back after it; training goes on unchanged; placeholders of ``deepspeed.zero.Init`` refuse too.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import run_distributed, single_world_size

REFUSED = "is partitioned by ZeRO-3"


def _train(ctx, read_between_steps: bool, backend=None):
    import deepcompile
    from deepcompile.zero.gathered_params import Gathered

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(ctx.device)
    engine = deepcompile.initialize(model, None, {"zero_optimization": {"stage": 3},
                                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    if backend is not None:
        engine.compile(backend=backend)
    losses = []
    try:
        g = torch.Generator().manual_seed(1 + ctx.rank)
        for step in range(3):
            x, y = torch.randn(4, 16, generator=g).to(ctx.device), torch.randn(4, 4, generator=g).to(ctx.device)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if read_between_steps:
                _check_reads(ctx, model, x, Gathered)
    finally:
        engine.destroy()
    return losses


def _check_reads(ctx, model, x, gathered):
    w = model[2].weight
    # Metadata is what a placeholder is for: the full shape, dtype and device.
    assert w.shape == (4, 32) and tuple(w.ds_shape) == (4, 32) and w.dtype == torch.float32
    assert w.device.type == ctx.device.type and w.untyped_storage().nbytes() == 4
    reads = {
        "sum": lambda: w.sum(),
        "matmul": lambda: x @ model[0].weight.t(),
        "clone": lambda: w.clone(),
        "print": lambda: repr(w),
        "functional": lambda: nn.functional.linear(torch.ones(1, 32, device=w.device), w),
    }
    names = {"sum": "'2.weight'", "matmul": "'0.weight'", "clone": "'2.weight'", "print": "'2.weight'",
             "functional": "'2.weight'"}
    for what, read in reads.items():
        with pytest.raises(RuntimeError, match=f"{names[what]} {REFUSED}.*GatheredParameters"):
            read()
    with pytest.raises(RuntimeError, match=REFUSED):
        torch.save(model.state_dict(), io.BytesIO())  # used to write NaN for every partitioned tensor
    # Inside a gathered block the values are there, the same on every rank, and finite.
    with gathered([w, model[2].bias]):
        full = w.detach().clone()
        assert torch.isfinite(full).all() and full.abs().sum() > 0
        everyone = [torch.empty_like(full) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(everyone, full)
        assert all(torch.equal(full, other) for other in everyone)
    with pytest.raises(RuntimeError, match=f"'2.weight' {REFUSED}"):
        w.sum()


def _engine_body(ctx, backend):
    reading = _train(ctx, read_between_steps=True, backend=backend)
    plain = _train(ctx, read_between_steps=False, backend=backend)
    assert reading == plain, f"refused reads changed training: {reading} vs {plain}"


@pytest.mark.world_size(2)
def test_reads_outside_the_forward_are_refused_by_name_and_gathered_reads_work():
    run_distributed(_engine_body, 2, args=(None,))


@pytest.mark.gpu
@pytest.mark.world_size(single_world_size())
def test_inductor_graphs_on_gpus_run_with_placeholders_that_refuse_reads():
    """Inductor checks the alignment of GPU inputs on every call by reading ``data_ptr()``; the
    placeholders reach it as static inputs, which it does not check (compiler/backend.py's
    ``gathered_only_inputs``). Without that, every compiled ZeRO-3 step on a GPU raised."""
    run_distributed(_engine_body, single_world_size(), args=("inductor",), timeout=600)


def test_gathered_only_inputs_are_the_inputs_only_gathers_and_the_output_take():
    import torch.fx as fx

    from deepcompile import ops
    from deepcompile.compiler.backend import gathered_only_inputs

    g = fx.Graph()
    param, saved, x, unused = (g.placeholder(n) for n in ("param", "saved", "x", "unused"))
    full = g.call_function(ops.ALLGATHER_PARAM, (param, 1, 0))
    other = g.call_function(ops.ALLGATHER_PARAM, (saved, 1, 1))
    y = g.call_function(torch.ops.aten.mm.default, (x, full))
    z = g.call_function(torch.ops.aten.mm.default, (y, other))
    g.output((z, saved, param))
    # x is read by a kernel; unused is read by nothing (Inductor's own business).
    assert gathered_only_inputs(fx.GraphModule({}, g)) == [0, 1]
    g2 = fx.Graph()
    p2 = g2.placeholder("param")
    g2.output((g2.call_function(ops.ALLGATHER_PARAM, (p2, 1, 0)), g2.call_function(torch.ops.aten.sum.default, (p2,))))
    assert gathered_only_inputs(fx.GraphModule({}, g2)) == []  # a kernel reads it: not exempt


def _zero_init_body(ctx):
    from deepcompile.integrations.deepspeed_api import zero_init

    torch.manual_seed(0)
    layer = nn.Linear(8, 6).to(ctx.device)
    values = layer.weight.detach().clone()
    torch.distributed.broadcast(values, 0)  # defer() keeps rank 0's values
    for p in layer.parameters():
        zero_init.defer(p, None)
    assert layer.weight.shape == (6, 8) and layer.weight.untyped_storage().nbytes() == 4
    with pytest.raises(RuntimeError, match=f"deepspeed.zero.Init {REFUSED}"):
        layer(torch.ones(2, 8, device=ctx.device))
    with zero_init.DeferredGather(list(layer.parameters()), modifier_rank=None):
        assert torch.equal(layer.weight.detach(), values)
    with pytest.raises(RuntimeError, match=REFUSED):
        layer.weight.sum()


@pytest.mark.world_size(2)
def test_zero_init_placeholders_refuse_reads_until_gathered():
    run_distributed(_zero_init_body, 2)
