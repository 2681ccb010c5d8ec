"""The torch internals deepcompile relies on: one check per name ``deepcompile.compat`` exports.

These fail loudly, in a test named after the cause, when a torch upgrade moves or removes
something, instead of letting gradients silently disappear from compiled graphs.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import deepcompile
from deepcompile import compat


def test_supported_torch_version():
    assert compat.TORCH_VERSION >= (2, 11), torch.__version__


# Each name compat exports -> the test that exercises it. A new export needs an entry here (and a
# test that calls it); the check below also reads the test's source, so an entry that points at a
# test which never calls the name fails too.
EXPORT_CHECKS = {
    "TORCH_VERSION": "test_supported_torch_version",
    "aot_backend": "test_aot_backend_compiles_both_halves",
    "boxed": "test_boxed_takes_one_argument_list",
    "bypass_idle_kernel_routing": "test_bypass_idle_kernel_routing_and_kernel_routed_modules",
    "compiled_output_strides": "test_inductor_compiler_for_later_and_compiled_output_strides",
    "default_store": "test_default_store_is_the_process_group_s_store",
    "direct_buffers": "test_direct_buffers",
    "direct_parameters": "test_direct_parameters_and_swap_parameter",
    "drop_module_compile": "test_drop_module_compile_runs_the_plain_forward_again",
    "eager_input_vals": "test_eager_input_vals_and_set_eager_input_vals_on_a_custom_op",
    "forbid_data_access": "test_forbid_data_access_refuses_reads_of_every_view_and_keeps_metadata",
    "foreach_mul_": "test_foreach_norm_and_foreach_mul_",
    "foreach_norm": "test_foreach_norm_and_foreach_mul_",
    "kernel_routed_modules": "test_bypass_idle_kernel_routing_and_kernel_routed_modules",
    "forward_inputs": "test_forward_inputs_are_the_graph_inputs_in_order",
    "gradient_output_index": "test_gradient_output_index_matches_backward_outputs",
    "inductor_compile": "test_inductor_compile_compiles_both_halves",
    "inductor_compiler_for_later": "test_inductor_compiler_for_later_and_compiled_output_strides",
    "inductor_decompositions": "test_inductor_decompositions_is_an_op_table",
    "inductor_joint_graph_passes": "test_inductor_joint_graph_passes_run_on_a_joint_graph",
    "is_incoming_gradient": "test_partition_forward_output_count_and_is_incoming_gradient",
    "is_op_overload": "test_is_op_overload_tells_operators_from_python_callables",
    "is_higher_order_op": "test_is_higher_order_op_tells_subgraph_calls_from_operators",
    "joint_primal_inputs": "test_joint_primal_inputs_are_the_graph_inputs_in_order",
    "lazy_graph_module": "test_lazy_graph_module_generates_code_only_when_called",
    "mark_boxed": "test_mark_boxed_makes_aot_autograd_pass_one_list",
    "mark_must_recompute": "test_mark_must_recompute_and_min_cut_partition_save_the_input_not_its_cast",
    "mark_ops_side_effectful": "test_mark_ops_side_effectful_for_fx_and_inductor",
    "min_cut_partition": "test_mark_must_recompute_and_min_cut_partition_save_the_input_not_its_cast",
    "never_compile_as_frame": "test_never_compile_as_frame_keeps_a_function_eager_but_inlinable",
    "node_position": "test_node_position_follows_graph_order_through_insertions",
    "operator_namespace": "test_operator_namespace_of_overloads_packets_and_callables",
    "overload_packet_name": "test_overload_packet_name_drops_namespace_and_overload",
    "partition_forward_output_count": "test_partition_forward_output_count_and_is_incoming_gradient",
    "protect_runtime_buffers_in_inductor": "test_protect_runtime_buffers_in_inductor_registers_lowerings",
    "register_backend": "test_register_backend_resolves_the_name_once",
    "returns_view_of_input": "test_returns_view_of_input_reads_the_schema",
    "save_forward_input_for_backward": "test_save_forward_input_for_backward_hands_the_input_to_the_backward",
    "saved_forward_inputs": "test_saved_forward_inputs_keep_their_names_in_the_backward",
    "set_eager_input_vals": "test_eager_input_vals_and_set_eager_input_vals_on_a_custom_op",
    "set_traced_value": "test_traced_value_and_set_traced_value_on_a_dynamo_graph",
    "share_always_called_hooks": "test_share_always_called_hooks_keeps_identical_layers_in_one_capture",
    "shares_storage": "test_shares_storage_on_real_and_fake_tensors",
    "storage_id": "test_storage_id_follows_the_storage_through_views_and_resizes",
    "storage_object": "test_storage_object_is_one_object_per_storage_and_keys_a_weak_dictionary",
    "stream_from_ids": "test_stream_from_ids_round_trips_a_stream",
    "swap_parameter": "test_direct_parameters_and_swap_parameter",
    "traced_value": "test_traced_value_and_set_traced_value_on_a_dynamo_graph",
    "tree_leaves": "test_tree_leaves_and_tree_map_only",
    "tree_map_only": "test_tree_leaves_and_tree_map_only",
    "weak_id_key_dictionary": "test_weak_id_key_dictionary_keys_by_identity_and_forgets_dead_tensors",
    "will_compile_frame": "test_will_compile_frame_inside_and_outside_compiled_code",
}


def _reachable_source(test_name: str) -> str:
    """The source of ``test_name`` and of every module-level function, class and fixture of this
    file it names (transitively): a test that calls a name through a fixture or a helper class
    (``aot_run`` -> ``_AotRun``) still counts as calling it."""
    import ast

    text = open(__file__, encoding="utf-8").read()
    defs = {n.name: n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    seen, todo = set(), [test_name]
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        for sub in ast.walk(defs[name]):
            if isinstance(sub, ast.Name):
                todo.append(sub.id)
            elif isinstance(sub, ast.arg):  # fixtures arrive as parameters named after them
                todo.append(sub.arg)
    return "\n".join(ast.get_source_segment(text, defs[name]) for name in sorted(seen))


def test_every_export_has_a_check():
    """Each name compat exports maps to a test of this file (EXPORT_CHECKS) that calls it."""
    import re

    exports, mapped = set(compat.__all__), set(EXPORT_CHECKS)
    assert not exports - mapped, f"compat exports with no test in EXPORT_CHECKS: {sorted(exports - mapped)}"
    assert not mapped - exports, f"EXPORT_CHECKS names what compat no longer exports: {sorted(mapped - exports)}"
    problems = []
    for name, test_name in sorted(EXPORT_CHECKS.items()):
        if not (test_name.startswith("test_") and callable(globals().get(test_name))):
            problems.append(f"{name}: {test_name} is not a test of this file")
        elif not re.search(rf"\bcompat\.{re.escape(name)}\b", _reachable_source(test_name)):
            problems.append(f"{name}: {test_name} never calls compat.{name}")
    assert not problems, "compat exports without a test that exercises them:\n  " + "\n  ".join(problems)


def test_mark_ops_side_effectful_for_fx_and_inductor():
    from deepcompile import ops

    compat.mark_ops_side_effectful(ops.SIDE_EFFECTFUL)
    from torch.fx.node import _side_effectful_functions

    for op in (torch.ops.dc.end_backward.default, torch.ops.dc.reduce_grad.default, torch.ops.dc.release_param.default,
               torch.ops.dc.reduce_grad.slot, ops.OFFLOAD_ACTIVATION, ops.FREE_AFTER):
        assert op in _side_effectful_functions
    g = torch.fx.Graph()
    node = g.call_function(torch.ops.dc.end_backward.default, ([], 1, False))
    assert node.is_impure()
    from torch._library.utils import is_impure  # what Inductor's FallbackKernel.has_side_effects asks

    assert is_impure(torch.ops.dc.reduce_grad.default)


def test_protect_runtime_buffers_in_inductor_registers_lowerings():
    from deepcompile import ops

    compat.protect_runtime_buffers_in_inductor(ops.INDUCTOR_PROTECTED_BUFFERS)
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


def test_extension_build_leaves_the_cxx_standard_to_torch():
    """setup.py passes no -std flag, so torch's BuildExtension adds the standard its headers need.

    torch 2.15's headers require C++20 (ATen.h errors out below it; 2.11 and 2.12 accept C++17),
    so the -std=c++17 setup.py used to pin broke the build of the extension there.
    """
    import ast

    from _harness.paths import ROOT

    setup_py = ROOT / "setup.py"
    if not setup_py.exists():
        pytest.skip("no setup.py next to the tests")
    strings = [node.value for node in ast.walk(ast.parse(setup_py.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    assert not [s for s in strings if s.startswith("-std=")]


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    deepcompile.runtime.cleanup()
    dist.destroy_process_group()


def test_default_store_is_the_process_group_s_store(one_rank_group):
    """The fault watchdog (deepcompile/faults/) keeps its records in the store the group was built with."""
    store = compat.default_store()
    assert isinstance(store, dist.Store)
    store.set("deepcompile/test", "alive")
    assert store.get("deepcompile/test") == b"alive"
    assert store.check(["deepcompile/test"]) and not store.check(["deepcompile/absent"])


def test_inductor_code_keeps_every_runtime_op(one_rank_group, monkeypatch):
    """End to end through Inductor: the generated code still calls gather, release and reduce."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                     "compile": {"selective_gather": False, "warmup_steps": 1,
                                                 "verify_plan": True}})
    engine.compile(backend="inductor")

    def step():
        loss = engine(torch.randn(3, 4)).sum()
        engine.backward(loss)
        engine.step()

    step()  # step 0: plain graphs, profiled; prefetch is planned after it
    step()  # step 1: the planned graphs, profiled (the plan is measured)
    _, codes = run_and_get_code(step)  # step 2 compiles the planned graphs: their first compiled run
    code = "\n".join(codes)
    for op in ("dc.prefetch_params_fused", "dc.allgather_param", "dc.wait_allgather", "dc.release_param",
               "dc.reduce_grad", "dc.end_backward"):
        assert op in code, f"{op} missing from Inductor's output"
    engine.destroy()
    torch._dynamo.reset()


# ---- aot_autograd -----------------------------------------------------------------------------


class _AotRun:
    """One torch.compile of ``f(w, x, b) = sum(bf16(x) @ bf16(w).T + b)`` through
    ``compat.aot_backend`` (``w`` and ``x`` need gradients, ``b`` does not), with compilers that
    record what aot_autograd hands them. ``mark`` marks the cast of ``w`` in the joint graph as
    must-recompute."""

    def __init__(self, mark: bool):
        self.dynamo_shapes = None  # shapes of Dynamo's graph inputs, in its order
        self.joint_primals = None
        self.fw_inputs = None
        self.bw_saved = None
        self.bw_outputs = None
        self.fw_saved = None  # (shape, dtype) of the tensors the forward saves for backward
        self.boxed_args = []
        self.num_fwd_outputs = None
        self.fw_output_names = None
        self.bw_placeholders = None

        def partition(joint, joint_inputs, **kwargs):
            self.num_fwd_outputs = compat.partition_forward_output_count(kwargs)
            self.joint_primals = compat.joint_primal_inputs(joint)
            if mark:
                w = self.joint_primals[self.w_index]
                casts = [n for n in joint.graph.nodes if n.op == "call_function" and n.args
                         and n.args[0] is w and "to_copy" in str(n.target)]
                assert casts, "no cast of w in the joint graph"
                compat.mark_must_recompute(joint, casts)
            return compat.min_cut_partition(joint, joint_inputs, **kwargs)

        def fw(gm, inputs):
            self.fw_inputs = compat.forward_inputs(gm)
            out = gm.graph.output_node().args[0]
            self.fw_output_names = [n.name if isinstance(n, torch.fx.Node) else None for n in out]
            self.fw_saved = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in out[1:]
                             if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
            return self._half(gm)

        def bw(gm, inputs):
            names = {n.name: i for i, n in enumerate(self.fw_inputs)}
            self.bw_saved = compat.saved_forward_inputs(gm, names)
            self.bw_outputs = list(gm.graph.output_node().args[0])
            self.bw_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            return self._half(gm)

        aot = compat.aot_backend(fw_compiler=fw, bw_compiler=bw, partition_fn=partition)

        def backend(gm, example_inputs):
            self.dynamo_shapes = [tuple(t.shape) for t in example_inputs]
            self.w_index = self.dynamo_shapes.index((3, 4))
            return aot(gm, example_inputs)

        def f(w, x, b):
            return ((x.to(torch.bfloat16) @ w.to(torch.bfloat16).t()).float() + b).sum()

        torch._dynamo.reset()
        torch.manual_seed(0)
        self.w = torch.randn(3, 4, requires_grad=True)
        x = torch.randn(2, 4, requires_grad=True)
        b = torch.randn(2, 3)
        torch.compile(f, backend=backend, fullgraph=True)(self.w, x, b).backward()
        reference = self.w.detach().clone().requires_grad_(True)
        f(reference, x.detach(), b).backward()
        self.expected_grad = reference.grad
        torch._dynamo.reset()

    def _half(self, gm):
        run = self

        class Half:
            def __call__(self, *args):
                run.boxed_args.append(len(args) == 1 and isinstance(args[0], list))
                return gm.forward(*args[0])

        half = Half()
        compat.mark_boxed(half)
        return half


@pytest.fixture(scope="module")
def aot_run():
    return _AotRun(mark=True)


def test_aot_backend_compiles_both_halves(aot_run):
    assert aot_run.fw_inputs is not None and aot_run.bw_outputs is not None
    torch.testing.assert_close(aot_run.w.grad, aot_run.expected_grad)


def test_mark_boxed_makes_aot_autograd_pass_one_list(aot_run):
    assert aot_run.boxed_args and all(aot_run.boxed_args)


def test_boxed_takes_one_argument_list():
    seen = []
    fn = compat.boxed(lambda a, b: seen.append((a, b)) or a + b)
    assert fn([1, 2]) == 3 and seen == [(1, 2)]


def test_joint_primal_inputs_are_the_graph_inputs_in_order(aot_run):
    assert [tuple(n.meta["val"].shape) for n in aot_run.joint_primals] == aot_run.dynamo_shapes


def test_forward_inputs_are_the_graph_inputs_in_order(aot_run):
    assert [tuple(n.meta["val"].shape) for n in aot_run.fw_inputs] == aot_run.dynamo_shapes


def test_mark_must_recompute_and_min_cut_partition_save_the_input_not_its_cast(aot_run):
    # The backward needs bf16(w) for x's gradient. Left alone the partitioner saves that cast (half
    # the bytes of w); marked, it saves w itself and recomputes the cast in the backward.
    unmarked = _AotRun(mark=False)
    assert ((3, 4), torch.bfloat16) in unmarked.fw_saved, f"probe no longer discriminates: {unmarked.fw_saved}"
    assert ((3, 4), torch.bfloat16) not in aot_run.fw_saved and ((3, 4), torch.float32) in aot_run.fw_saved


def test_saved_forward_inputs_keep_their_names_in_the_backward(aot_run):
    assert aot_run.w_index in aot_run.bw_saved.values(), "w is saved for backward but not found by name"


def test_partition_forward_output_count_and_is_incoming_gradient(aot_run):
    # f returns one value (the loss): the caller sees one forward output, the rest are saved, and
    # each saved value is a backward placeholder of the same name; the others are incoming gradients.
    assert aot_run.num_fwd_outputs == 1
    saved = {n for n in aot_run.fw_output_names[1:] if n is not None}
    incoming = [n for n in aot_run.bw_placeholders if compat.is_incoming_gradient(n)]
    assert len(incoming) == 1
    assert {n.name for n in aot_run.bw_placeholders if not compat.is_incoming_gradient(n)} == saved


def test_weak_id_key_dictionary_keys_by_identity_and_forgets_dead_tensors():
    d = compat.weak_id_key_dictionary()
    a, b = torch.zeros(3), torch.zeros(3)  # equal values, distinct tensors
    d[a], d[b] = 1, 2
    assert d[a] == 1 and d[b] == 2 and len(d) == 2
    del a
    import gc

    gc.collect()
    assert len(d) == 1


def test_gradient_output_index_matches_backward_outputs(aot_run):
    outputs = aot_run.bw_outputs
    assert len(outputs) == 3  # one per forward input
    for index, shape in enumerate(aot_run.dynamo_shapes):
        grad = outputs[compat.gradient_output_index(index)]
        if shape == (2, 3):
            assert grad is None  # b needs no gradient
        else:
            assert isinstance(grad, torch.fx.Node) and tuple(grad.meta["val"].shape) == shape


# ---- Inductor, Dynamo --------------------------------------------------------------------------


def test_inductor_decompositions_is_an_op_table():
    table = compat.inductor_decompositions()
    assert table and all(callable(fn) for fn in table.values())
    assert torch.ops.aten.gelu_backward.default in table or torch.ops.aten.addmm.default in table


def test_inductor_compile_compiles_both_halves(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    backend = compat.aot_backend(
        fw_compiler=lambda gm, inputs: compat.inductor_compile(gm, inputs, is_backward=False),
        bw_compiler=lambda gm, inputs: compat.inductor_compile(gm, inputs, is_backward=True),
        partition_fn=compat.min_cut_partition,
        decompositions=compat.inductor_decompositions(),
    )
    torch._dynamo.reset()
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(2, 4)
    out = torch.compile(lambda w, x: torch.relu(x @ w.t()).sum(), backend=backend)(w, x)
    out.backward()
    reference = w.detach().clone().requires_grad_(True)
    torch.relu(x @ reference.t()).sum().backward()
    torch.testing.assert_close(out, torch.relu(x @ w.detach().t()).sum())
    torch.testing.assert_close(w.grad, reference.grad)
    torch._dynamo.reset()


def test_register_backend_resolves_the_name_once():
    from torch._dynamo.backends.registry import lookup_backend

    def probe(gm, example_inputs):
        return gm.forward

    compat.register_backend("dc_compat_probe", probe)
    compat.register_backend("dc_compat_probe", probe)  # registered already: no duplicate error
    assert lookup_backend("dc_compat_probe") is probe
    assert lookup_backend("deepcompile") is deepcompile.compiler.compiled_module.deepcompile_backend


# ---- FX and operators --------------------------------------------------------------------------


def test_is_higher_order_op_tells_subgraph_calls_from_operators():
    """Activation checkpointing's tag_activation_checkpoint, as Dynamo captures a checkpointed call,
    is one; aten operators and Python callables are not."""
    import torch.utils.checkpoint

    def fn(x):
        return torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)

    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(torch.ones(2))
    torch._dynamo.reset()
    assert any(compat.is_higher_order_op(t) for t in targets), targets
    assert not compat.is_higher_order_op(torch.ops.aten.mm.default) and not compat.is_higher_order_op(torch.add)


def test_is_op_overload_tells_operators_from_python_callables():
    assert compat.is_op_overload(torch.ops.aten.mm.default)
    assert not compat.is_op_overload(torch.add) and not compat.is_op_overload(torch.ops.aten.mm)


def test_overload_packet_name_drops_namespace_and_overload():
    assert compat.overload_packet_name(torch.ops.aten.mm.default) == "mm"
    assert compat.overload_packet_name(torch.ops.aten.add.Tensor) == "add"


def test_returns_view_of_input_reads_the_schema():
    assert compat.returns_view_of_input(torch.ops.aten.t.default)
    assert compat.returns_view_of_input(torch.ops.aten.expand.default)
    assert not compat.returns_view_of_input(torch.ops.aten.mm.default)
    assert not compat.returns_view_of_input(torch.ops.aten.add_.Tensor)  # writes: not a view


@torch.library.custom_op("dc_compat_test::scale", mutates_args=())
def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@_scale.register_fake
def _(x, s):
    return torch.empty_like(x)


def test_eager_input_vals_and_set_eager_input_vals_on_a_custom_op():
    """Custom ops need exact strides by default, so tracing records their inputs' fake values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: _scale(x.t(), 2.0), tracing_mode="fake")(torch.randn(3, 4))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.dc_compat_test.scale.default)
    recorded = compat.eager_input_vals(node)
    assert recorded is not None, "torch no longer records eager_input_vals for stride-sensitive ops"
    args, kwargs = recorded
    assert tuple(args[0].stride()) == (1, 4)  # the transposed view, as traced
    replacement = torch.empty(4, 3)
    compat.set_eager_input_vals(node, (replacement, 2.0), kwargs)
    assert compat.eager_input_vals(node)[0][0] is replacement
    plain = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert compat.eager_input_vals(plain) is None


def test_lazy_graph_module_generates_code_only_when_called():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.add, (x, 1)))
    gm = compat.lazy_graph_module(torch.nn.Module(), g)
    assert isinstance(gm, torch.fx.GraphModule)
    # No code yet: the lazy forward stands in until the first call (what the saving is).
    from torch.fx._lazy_graph_module import _LazyGraphModule

    assert isinstance(gm, _LazyGraphModule) and gm._needs_recompile()
    # An interpreter reads the graph only, and leaves it so.
    assert torch.equal(torch.fx.Interpreter(gm).run(torch.ones(2)), torch.full((2,), 2.0))
    assert gm._needs_recompile()
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 2.0)) and not gm._needs_recompile()
    assert "torch.add" in gm.code


def test_node_position_follows_graph_order_through_insertions():
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    b = graph.call_function(torch.add, (a, a))
    c = graph.call_function(torch.mul, (b, b))
    graph.output(c)
    with graph.inserting_before(c):
        d = graph.call_function(torch.neg, (b,))
    with graph.inserting_after(a):
        e = graph.call_function(torch.abs, (a,))
    nodes = list(graph.nodes)
    assert nodes == [a, e, b, d, c, nodes[-1]]
    assert sorted(reversed(nodes), key=compat.node_position) == nodes


def test_tree_leaves_and_tree_map_only():
    tree = (1, [torch.zeros(1), {"a": 2.0}])
    assert len(compat.tree_leaves(tree)) == 3
    mapped = compat.tree_map_only(torch.Tensor, lambda t: "T", tree)
    assert mapped == (1, ["T", {"a": 2.0}])


# ---- modules, tensors --------------------------------------------------------------------------


def test_direct_parameters_and_swap_parameter():
    lin = torch.nn.Linear(2, 2, bias=False)
    params = compat.direct_parameters(lin)
    assert params["weight"] is lin.weight and params.get("bias") is None  # None: registered as absent
    original = lin.weight
    doubled = original * 2  # a non-leaf tensor: nn.Module.__setattr__ would refuse it
    compat.swap_parameter(lin, "weight", doubled)
    x = torch.ones(1, 2)
    torch.testing.assert_close(lin(x), x @ doubled.t())
    compat.swap_parameter(lin, "weight", original)
    assert lin.weight is original and isinstance(lin.weight, torch.nn.Parameter)


def test_direct_buffers():
    norm = torch.nn.BatchNorm1d(3)
    norm.register_buffer("absent", None)
    buffers = compat.direct_buffers(norm)
    assert buffers["running_mean"] is norm.running_mean and buffers["absent"] is None
    seq = torch.nn.Sequential(norm)
    assert dict(compat.direct_buffers(seq)) == {}  # a child's buffers are not the parent's
    replacement = torch.ones(3)
    setattr(norm, "running_mean", replacement)  # assignment writes the same live dict
    assert buffers["running_mean"] is replacement


def test_foreach_norm_and_foreach_mul_():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([6.0, 8.0])
    assert [float(n) for n in compat.foreach_norm([a, b])] == [5.0, 10.0]
    compat.foreach_mul_([a, b], torch.tensor(0.5))
    assert a.tolist() == [1.5, 2.0] and b.tolist() == [3.0, 4.0]


def test_operator_namespace_of_overloads_packets_and_callables():
    assert compat.operator_namespace(torch.ops.aten.mm.default) == "aten"
    assert compat.operator_namespace(torch.ops.aten.mm) == "aten"
    assert compat.operator_namespace(torch.ops.dc.allgather_param) == "dc"
    assert compat.operator_namespace(torch.mm) is None


def test_shares_storage_on_real_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    base = torch.zeros(4, 3)
    assert compat.shares_storage(base.t(), base) and compat.shares_storage(base[1:], base)
    assert not compat.shares_storage(base.clone(), base)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(base)
        assert compat.shares_storage(fake.transpose(0, 1), fake)
        assert not compat.shares_storage(fake.clone(), fake)


def test_forbid_data_access_refuses_reads_of_every_view_and_keeps_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    one = torch.full((1,), 2.0)
    compat.forbid_data_access(one, "no values here")
    placeholder = one.expand(3, 4)
    for read in (lambda: placeholder.sum(), lambda: one.clone(), lambda: placeholder.t() @ torch.ones(3),
                 lambda: repr(placeholder)):
        with pytest.raises(RuntimeError, match="no values here"):
            read()
    assert placeholder.shape == (3, 4) and placeholder.stride() == (0, 0) and placeholder.dtype == torch.float32
    with FakeTensorMode() as mode:  # what Dynamo makes of a parameter: shape without data
        fake = mode.from_tensor(placeholder)
        assert (fake @ torch.ones(4)).shape == (3,)
    assert torch.full((1,), 2.0).sum().item() == 2.0  # other storages are unaffected


def test_storage_id_follows_the_storage_through_views_and_resizes():
    base = torch.arange(12.0)
    key = compat.storage_id(base)
    assert compat.storage_id(base[3:7]) == key and compat.storage_id(base.view(3, 4).t()) == key
    other = base.clone()
    assert compat.storage_id(other) != key
    base.untyped_storage().resize_(0)  # what optimizer-state offload does to a device copy
    assert compat.storage_id(base) == key
    base.untyped_storage().resize_(12 * 4)
    assert compat.storage_id(base) == key and compat.storage_id(other) != key


def test_storage_object_is_one_object_per_storage_and_keys_a_weak_dictionary():
    import gc

    buffer = torch.arange(4.0).reshape(4, 1)
    alias = buffer.as_strided((4, 1), (1, 1), 0)  # another tensor object, as reinterpret_tensor makes
    assert compat.storage_object(alias) is compat.storage_object(buffer)
    assert compat.storage_object(buffer.clone()) is not compat.storage_object(buffer)
    d = compat.weak_id_key_dictionary()
    d[compat.storage_object(buffer)] = "host copy"
    buffer.untyped_storage().resize_(0)  # freed the way offload frees it: still the same storage
    assert d.get(compat.storage_object(alias)) == "host copy"
    del buffer, alias
    gc.collect()
    assert len(d) == 0  # the entry dies with the storage


def test_traced_value_and_set_traced_value_on_a_dynamo_graph():
    seen = []

    def backend(gm, example_inputs):
        nodes = list(gm.graph.nodes)
        seen.extend((n.op, compat.traced_value(n)) for n in nodes)
        compat.set_traced_value(nodes[-2], torch.ones(1))
        seen.append(("set", compat.traced_value(nodes[-2])))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x.t() * 2, backend=backend)(torch.ones(2, 3))
    tensors = {op: v for op, v in seen if v is not None}
    assert tuple(tensors["placeholder"].shape) == (2, 3) and tuple(tensors["call_function"].shape) == (3, 2)
    assert seen[-1][1] is not None and seen[-1][1].shape == (1,)
    assert compat.traced_value(torch.fx.Graph().placeholder("x")) is None


def test_never_compile_as_frame_keeps_a_function_eager_but_inlinable():
    compiled_graphs = []

    def eager_only():
        return torch.compiler.is_compiling()

    def counting_backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    compat.never_compile_as_frame(eager_only)
    torch._dynamo.reset()
    # As a frame of its own (here: the compiled function itself) it runs eagerly.
    assert torch.compile(eager_only, backend=counting_backend)() is False
    assert compiled_graphs == []
    # Inlined into a traced caller it is still traced (is_compiling true inside the graph).
    traced = torch.compile(lambda x: x * 2 if eager_only() else x, backend=counting_backend, fullgraph=True)
    assert torch.equal(traced(torch.ones(1)), torch.full((1,), 2.0))
    assert len(compiled_graphs) == 1


def test_will_compile_frame_inside_and_outside_compiled_code():
    seen = {}

    def user_function():
        return None

    @torch.compiler.disable
    def disabled():
        return None

    def probe():
        seen["user"] = compat.will_compile_frame(user_function)
        seen["disabled"] = compat.will_compile_frame(disabled)
        seen["torch_module"] = compat.will_compile_frame(torch.nn.Linear(1, 1).forward)
        hooked = torch.nn.Linear(1, 1)
        hooked.register_forward_pre_hook(lambda m, a: None)
        seen["torch_module_with_hook"] = compat.will_compile_frame(hooked.forward)

    compat.never_compile_as_frame(probe, recursive=False)  # recursive would deactivate Dynamo inside
    assert compat.will_compile_frame(user_function) is False  # no compile region

    def region(x):
        torch._dynamo.graph_break()
        probe()
        return x + 1

    torch._dynamo.reset()
    torch.compile(region, backend="eager")(torch.ones(1))
    # torch 2.12 compiles a torch module's forward as a frame when the module has hooks; 2.11 not.
    assert seen == {"user": True, "disabled": False, "torch_module": False,
                    "torch_module_with_hook": compat.TORCH_VERSION >= (2, 12)}


def test_inductor_compiler_for_later_and_compiled_output_strides(monkeypatch):
    """A forward half compiled again after aot_autograd's callback returned (re-planning in
    place) computes what the first compile did, and reports its output strides."""
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    kept = {}

    def fw_compiler(gm, inputs):
        kept["later"] = compat.inductor_compiler_for_later(inputs, is_backward=False)
        kept["gm"] = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        kept["first"] = compat.inductor_compile(gm, inputs, is_backward=False)
        return kept["first"]

    backend = compat.aot_backend(
        fw_compiler=fw_compiler,
        bw_compiler=lambda gm, inputs: compat.inductor_compile(gm, inputs, is_backward=True),
        partition_fn=compat.min_cut_partition,
        decompositions=compat.inductor_decompositions(),
    )
    torch._dynamo.reset()
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(2, 4)
    torch.compile(lambda w, x: torch.relu(x @ w.t()).sum(), backend=backend)(w, x).backward()
    again = kept["later"](kept["gm"])  # outside any compile context now
    args = [w.detach(), x]
    torch.testing.assert_close(list(again(list(args))), list(kept["first"](list(args))))
    strides = compat.compiled_output_strides(again)
    assert strides is not None and len(strides) == len(kept["first"](list(args)))
    assert strides == compat.compiled_output_strides(kept["first"])
    assert compat.compiled_output_strides(lambda args: args) is None  # not Inductor's code
    torch._dynamo.reset()


def test_stream_from_ids_round_trips_a_stream():
    if torch.cuda.is_available():
        current = torch.cuda.current_stream()
        wrapped = compat.stream_from_ids(current.stream_id, current.device_index, current.device_type)
        assert isinstance(wrapped, torch.cuda.Stream)
        assert wrapped == current and wrapped.cuda_stream == current.cuda_stream
    wrapped = compat.stream_from_ids(0, -1, 0)  # the CPU's default stream
    assert isinstance(wrapped, torch.Stream)
    assert (wrapped.stream_id, wrapped.device_index, wrapped.device) == (0, -1, torch.device("cpu"))


def test_save_forward_input_for_backward_hands_the_input_to_the_backward():
    # b is a forward input the backward does not need; saved after the partition, the backward
    # receives it under the given name, the gradients unchanged.
    seen = {}

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = compat.min_cut_partition(joint, joint_inputs, **kwargs)
        n = compat.partition_forward_output_count(kwargs)
        seen["node"] = compat.save_forward_input_for_backward(fw, bw, 2, n, "dc_saved_b")
        return fw, bw

    def fw(gm, inputs):
        return compat.boxed(gm.forward)

    def bw(gm, inputs):
        placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
        index = [p.name for p in placeholders].index("dc_saved_b")
        assert seen["node"].name == "dc_saved_b"  # aot_autograd may hand over a copy of the graph
        assert not compat.is_incoming_gradient(placeholders[index])

        def run(args):
            seen["value"] = args[index].clone()
            return gm.forward(*args)

        return compat.boxed(lambda *args: run(list(args)))

    def f(w, x, b):
        return ((x @ w.t()) * 2).sum() + b.sum() * 0

    torch._dynamo.reset()
    torch.manual_seed(0)
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    b = torch.randn(5)
    torch.compile(f, backend=compat.aot_backend(fw, bw, partition), fullgraph=True)(w, x, b).backward()
    torch._dynamo.reset()
    torch.testing.assert_close(seen["value"], b)
    rw, rx = w.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    f(rw, rx, b).backward()
    torch.testing.assert_close(w.grad, rw.grad)
    torch.testing.assert_close(x.grad, rx.grad)


def test_drop_module_compile_runs_the_plain_forward_again():
    traced = []

    def backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    class Double(torch.nn.Module):  # not a torch.nn class: Dynamo traces its forward as a frame
        def forward(self, x):
            return x * 2

    torch._dynamo.reset()
    module = Double()
    module.compile(backend=backend)
    module(torch.randn(1, 2))
    assert len(traced) == 1
    compat.drop_module_compile(module)
    torch._dynamo.reset()
    module(torch.randn(1, 2))
    assert len(traced) == 1, "the module still ran compiled"


def test_share_always_called_hooks_keeps_identical_layers_in_one_capture():
    """Forward hooks that run even when the forward raises, on identical layers compiled one by
    one: with one shared registry Dynamo captures the layer once (its guards name the first
    layer's hook id); the hooks still run on a raising forward; the undo gives each module back
    a registry of its own hooks."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    class Failing(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("stop")

    ran = []

    def hook(module, args, output):
        if not torch.compiler.is_compiling():
            ran.append(module)

    def captures(shared: bool) -> int:
        torch._dynamo.reset()
        layers = [Layer() for _ in range(3)]
        inner = [layer.lin for layer in layers]
        undo = compat.share_always_called_hooks(inner) if shared else (lambda: None)
        handles = [m.register_forward_hook(hook, always_call=True) for m in inner]
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        for layer in layers:
            layer.compile(backend=backend)
        x = torch.randn(2, 4, requires_grad=True)  # every layer's input alike
        for layer in layers:
            x = layer(x)
        for h in handles:
            h.remove()
        undo()
        torch._dynamo.reset()
        return len(graphs)

    assert captures(shared=False) == 3  # what the shared registry prevents
    assert captures(shared=True) == 1

    failing = [Failing(), Failing()]
    undo = compat.share_always_called_hooks(failing)
    ran.clear()
    handles = [m.register_forward_hook(hook, always_call=True) for m in failing]
    with pytest.raises(RuntimeError, match="stop"):
        failing[1](torch.zeros(1))
    assert ran == [failing[1]], "the always-called hook ran for the raising module only"
    undo()
    for module, handle in zip(failing, handles):
        assert dict(module._forward_hooks_always_called) == {handle.id: True}
    assert failing[0]._forward_hooks_always_called is not failing[1]._forward_hooks_always_called


def test_bypass_idle_kernel_routing_and_kernel_routed_modules():
    """kernels' routing wrapper (transformers >= 5.25 puts it on attention modules) is recognised;
    modules whose wrappers select no hub kernel get their original forward, a kernelized one keeps
    the routing; outputs are unchanged. (tests/compat/test_hub_kernels.py: Dynamo and
    checkpointing on a transformers model.)"""
    kernels = pytest.importorskip("kernels")

    @kernels.use_kernel_forward_from_hub("DeepcompileCompatIdentity")
    def identity(x):
        return x

    @kernels.use_kernelized_func(identity)
    class Routed(torch.nn.Module):
        def forward(self, x):
            return identity(x) * 2

    outer = torch.nn.Sequential(Routed(), Routed())
    assert compat.kernel_routed_modules(outer) == ["0", "1"]
    wrapper = next(iter(outer[1]._kernel_funcs.values()))
    wrapper.forward = type(wrapper).forward.__get__(wrapper)  # as kernelize sets a hub layer's forward
    assert compat.bypass_idle_kernel_routing(outer) == ["0"]
    assert compat.kernel_routed_modules(outer) == ["1"]
    x = torch.arange(3.0)
    assert torch.equal(outer(x), x * 4)
