"""The engine's run summary (deepcompile/run_summary.py) and the served engine's take-over of
accelerate's per-layer compilation (deepcompile/integrations/deepspeed_api/run_summary.py), on
plain modules and stand-ins: no process group."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from deepcompile import run_summary as summary
from deepcompile.integrations.deepspeed_api import run_summary


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _engine(regions=()):
    return SimpleNamespace(compiled_module=SimpleNamespace(regions=list(regions)))


def test_accelerates_per_layer_compile_is_undone_and_its_classes_returned():
    """accelerate's compile_regions_deepspeed calls module.compile() on each repeated block: the
    blocks run their plain forward again and their class is what the engine compiles per layer."""
    model = Model()
    for layer in model.layers:
        layer.compile(backend="eager")
    assert all(layer._compiled_call_impl is not None for layer in model.layers)
    assert run_summary.take_over_regional_compile(model, _engine()) == [Block]
    assert all(layer._compiled_call_impl is None for layer in model.layers)
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), model.head(model.layers[1](model.layers[0](x))))


def test_the_engines_own_regions_and_uncompiled_models_are_left_alone():
    model = Model()
    assert run_summary.take_over_regional_compile(model, _engine()) == []
    for layer in model.layers:
        layer.compile(backend="eager")
    assert run_summary.take_over_regional_compile(model, _engine(model.layers)) == []
    assert all(layer._compiled_call_impl is not None for layer in model.layers)


def test_summary_names_stage_dtypes_offload_and_compilation():
    from deepcompile.engine import CompiledAs

    model = Model().to(torch.bfloat16)
    config = SimpleNamespace(zero_optimization=SimpleNamespace(offload_optimizer=object(), offload_param=None),
                             compile=SimpleNamespace(offload_opt_states=False, offload_parameters=False,
                                                     offload_activation=True, auto_compile=None))
    schedule = SimpleNamespace(entries=[SimpleNamespace(step=0, passes=frozenset()),
                                        SimpleNamespace(step=5, passes=frozenset({"prefetch"}))])
    engine = SimpleNamespace(config=config, module=model, stage=3, world_size=4, rank=0,
                             topology=SimpleNamespace(hybrid=True, shard_size=2),
                             precision=SimpleNamespace(param_dtype=None, zero3_reduce_dtype=torch.float32),
                             compiled_as=CompiledAs("inductor", [Block], {"mode": "max-autotune"}),
                             scheduler=SimpleNamespace(schedule=schedule))
    line = summary.describe(engine)
    assert line == ("deepcompile engine: ZeRO-3 over 4 ranks (hybrid: shard groups of 2); compute in bfloat16, fp32 "
                    "master weights and optimizer state, gradients reduced in float32; offload: optimizer state, "
                    "activations; compiled (inductor, per layer: Block, mode=max-autotune); prefetch from step 5")
    engine.compiled_as, engine.stage = None, 2
    line = summary.describe(engine)
    assert "ZeRO-2" in line and "gradients reduced in bfloat16" in line
    assert line.endswith("uncompiled (eager ZeRO hooks; engine.compile() was not called)")
    config.compile.auto_compile = False
    assert summary.describe(engine).endswith("uncompiled (eager ZeRO hooks; compile.auto_compile is false)")
