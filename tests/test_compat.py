"""The torch internals deepcompile relies on (all used from deepcompile/compat.py).

These fail loudly when a torch upgrade moves or removes something, instead of letting gradients
silently disappear from compiled graphs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import deepcompile
from deepcompile import compat


def test_supported_torch_version():
    assert compat.TORCH_VERSION >= (2, 11), torch.__version__


def test_ops_are_side_effectful_for_fx_and_inductor():
    compat.mark_ops_side_effectful()
    from torch.fx.node import _side_effectful_functions

    for op in (torch.ops.dc.end_backward.default, torch.ops.dc.reduce_grad.default, torch.ops.dc.release_param.default):
        assert op in _side_effectful_functions
    g = torch.fx.Graph()
    node = g.call_function(torch.ops.dc.end_backward.default, ([], 1, False))
    assert node.is_impure()
    from torch._library.utils import is_impure  # what Inductor's FallbackKernel.has_side_effects asks

    assert is_impure(torch.ops.dc.reduce_grad.default)


def test_inductor_lowerings_protect_runtime_buffers():
    compat.protect_runtime_buffers_in_inductor()
    from torch._inductor.graph import GraphLowering
    from torch._inductor.lowering import lowerings

    for op in (torch.ops.dc.allgather_param.default, torch.ops.dc.wait_allgather.default, torch.ops.dc.reduce_grad.default):
        assert op in lowerings
    import inspect

    # The lowerings add names to this per-graph set; it must still exist and be consulted.
    assert "never_reuse_buffers" in inspect.getsource(GraphLowering.__init__)


def test_inductor_joint_graph_passes_run_on_a_joint_graph():
    # A no-op cast chain (fp32 -> fp32) is one of the things the joint-graph passes remove.
    def f(x):
        return torch.ops.prims.convert_element_type.default(x, torch.float32) * 2

    gm = torch.fx.symbolic_trace(f)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    with FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(torch.empty(4))
    out = compat.inductor_joint_graph_passes(gm, [torch.empty(4)])
    assert isinstance(out, torch.fx.GraphModule)
    assert not any(n.target is torch.ops.prims.convert_element_type.default for n in out.graph.nodes)


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    deepcompile.runtime.cleanup()
    dist.destroy_process_group()


def test_inductor_code_keeps_every_runtime_op(one_rank_group, monkeypatch):
    """End to end through Inductor: the generated code still calls gather, release and reduce."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                     "compile": {"selective_gather": False, "warmup_steps": 1}})
    engine.compile(backend="inductor")

    def step():
        loss = engine(torch.randn(3, 4)).sum()
        engine.backward(loss)
        engine.step()

    step()  # step 0: plain graphs, profiled; prefetch is planned after it
    _, codes = run_and_get_code(step)  # step 1 compiles the graphs with prefetch
    code = "\n".join(codes)
    for op in ("dc.prefetch_params_fused", "dc.allgather_param", "dc.wait_allgather", "dc.release_param",
               "dc.reduce_grad", "dc.end_backward"):
        assert op in code, f"{op} missing from Inductor's output"
    engine.destroy()
    torch._dynamo.reset()
