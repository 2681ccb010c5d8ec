"""Single-process checks of the ``torch.ops.dc`` op surface: schemas (alias / mutation
annotations must say what each op does to its inputs: an op that returns its input declares
``Tensor(a)``, one that frees its inputs declares ``Tensor(a!)``, the others declare neither, so
functionalization and Inductor neither copy around nor reorder them wrongly),
``torch.library.opcheck``, and the fake / meta kernels (DeepSpeed's fake result of
allgather_param without a dtype was float32 whatever the parameter dtype; here it has the
shard's dtype).

The runtime needs a process group even here: a 1-rank gloo group is created for the module.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from deepcompile import runtime
from deepcompile.runtime import RuntimeConfig
from deepcompile.zero.partition import make_placeholder

ops = torch.ops.dc
GRAPH = 7
THRESHOLD_BYTES = 64

# The op contract (namespace dc). Compared as parsed schemas, so whitespace does not matter but
# names, types, defaults and alias annotations do.
EXPECTED_SCHEMAS = {
    "allgather_param": "(Tensor a, int graph_id, int id, ScalarType? dtype=None) -> Tensor",
    "prefetch_params_fused": "(int graph_id, Tensor[] params, int[] ids, ScalarType[]? dtypes=None) -> ()",
    "wait_allgather": "(Tensor(a) a, int graph_id, int id) -> Tensor(a)",
    "release_param": "(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)",
    "reduce_grad": "(Tensor a, int graph_id, int id) -> Tensor",
    "end_backward": "(Tensor[] deps, int graph_id, bool release_reduce_buckets) -> ()",
    "free_tensors": "(Tensor(a!)[] a) -> ()",
}
# The slot overloads compiled code calls (passes/slot_ops.py): graph instance and slot as data.
EXPECTED_SLOT_SCHEMAS = {
    "allgather_param": "(Tensor a, Tensor graph, int slot, ScalarType? dtype=None) -> Tensor",
    "prefetch_params_fused": "(Tensor[] params, Tensor graph, int[] slots, ScalarType[]? dtypes=None) -> ()",
    "wait_allgather": "(Tensor(a) a, Tensor graph, int slot) -> Tensor(a)",
    "release_param": "(Tensor(a) a, Tensor graph, int slot, int n_users) -> Tensor(a)",
    "reduce_grad": "(Tensor a, Tensor graph, int slot) -> Tensor",
    "end_backward": "(Tensor[] deps, Tensor graph, bool release_reduce_buckets) -> ()",
}

# Only the two checks every op here can take part in. Not used, and why:
# * test_autograd_registration: the ops are inserted into the forward/backward graphs after AOT
#   autograd partitioned them and never see inputs that require grad; the util only does
#   something for requires_grad inputs.
# * test_aot_dispatch_dynamic: runs the op through functionalization + torch.compile as a
#   user-visible op; these ops act on runtime state (a gather changes the registry, a reduce
#   queues a task) and are never traced by AOT autograd, so the eager-vs-compiled comparison
#   does not describe how they are used.
OPCHECK_UTILS = ("test_schema", "test_faketensor")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    created = False
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        created = True
    yield dist.group.WORLD
    runtime.cleanup()
    if created:
        dist.destroy_process_group()


@pytest.fixture
def rt(process_group):
    """A fresh 1-rank runtime (CPU) per test."""
    runtime.init(
        process_group,
        RuntimeConfig(reduce_bucket_size=1024, free_activation_threshold=THRESHOLD_BYTES),
        device="cpu",
    )
    yield
    runtime.cleanup()


def _register_z3(ds_id, shape, dtype=torch.float32, persistent=False, graph_id=GRAPH):
    """One ZeRO-3 param on 1 rank (the shard is the whole flat param) in a stage-3 graph."""
    g = torch.Generator().manual_seed(ds_id)
    full = torch.randn(shape, generator=g).to(dtype)
    shard = full.reshape(-1).clone()
    target = torch.zeros(shard.numel(), dtype=dtype)
    runtime.register_z3_param(ds_id, shape, shard, target, persistent=persistent)
    runtime.register_graph(graph_id, [ds_id], 3)
    return full, shard, target


# ----------------------------------------------------------------------------------------------
# schemas
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEMAS))
def test_schema(name):
    assert hasattr(ops, name), f"torch.ops.dc.{name} is not registered"
    got = getattr(ops, name).default._schema
    want = torch._C.parse_schema(f"dc::{name}{EXPECTED_SCHEMAS[name]}")
    assert got == want, f"\n got: {got}\nwant: {want}"


@pytest.mark.parametrize("name", sorted(EXPECTED_SLOT_SCHEMAS))
def test_slot_schema(name):
    got = getattr(ops, name).slot._schema
    want = torch._C.parse_schema(f"dc::{name}.slot{EXPECTED_SLOT_SCHEMAS[name]}")
    assert got == want, f"\n got: {got}\nwant: {want}"


def _every_overload():
    """(name, OpOverload) of every dc op: each default overload and each slot overload."""
    for name in sorted(EXPECTED_SCHEMAS):
        yield name, getattr(ops, name).default
    for name in sorted(EXPECTED_SLOT_SCHEMAS):
        yield f"{name}.slot", getattr(ops, name).slot


@pytest.mark.parametrize("name,overload", list(_every_overload()), ids=lambda v: v if isinstance(v, str) else "")
def test_cudagraph_unsafe_tag(name, overload):
    """Every dc op talks to the runtime and its communicators (host state, collectives on the
    runtime's own streams), which a CUDA graph replay would skip: each carries
    ``torch.Tag.cudagraph_unsafe``, so Inductor's CUDA graphs never capture one."""
    assert torch.Tag.cudagraph_unsafe in overload.tags, f"dc.{name} lacks the cudagraph_unsafe tag: {overload.tags}"


def test_alias_annotations():
    """Spelled out: outputs that are an input say so with (a); free_tensors declares (a!)."""

    def alias(arg_or_ret):
        info = arg_or_ret.alias_info
        return None if info is None else (sorted(info.before_set), info.is_write)

    for name in ("wait_allgather", "release_param"):
        s = getattr(ops, name).default._schema
        assert alias(s.arguments[0]) == (["a"], False), f"{name}: input must be Tensor(a)"
        assert alias(s.returns[0]) == (["a"], False), f"{name}: output must be Tensor(a)"
    s = ops.free_tensors.default._schema
    # For a list the set name sits on the element type; the list itself carries is_write.
    assert s.arguments[0].alias_info is not None and s.arguments[0].alias_info.is_write, (
        "free_tensors must declare Tensor(a!)[]"
    )
    assert "Tensor(a!)[]" in str(s)
    for name in ("allgather_param", "reduce_grad"):
        s = getattr(ops, name).default._schema
        assert all(alias(a) is None for a in s.arguments), f"{name}: no input aliasing/mutation declared"
        assert alias(s.returns[0]) is None, f"{name}: output is a fresh tensor as far as inputs go"


# ----------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------


def readable_placeholder(shape, dtype, device) -> torch.Tensor:
    """A placeholder's shape and layout (one element, expanded) over a storage that can be read:
    opcheck reads every input to check that none was mutated, which a real placeholder refuses."""
    return torch.full((1,), float("nan"), dtype=dtype, device=device).expand(shape)


def test_opcheck_allgather_param(rt):
    full, shard, _ = _register_z3(3, (5, 3))
    # Traced calls pass the parameter's placeholder: the fake kernel takes the shape from it.
    placeholder = readable_placeholder(full.shape, full.dtype, full.device)
    torch.library.opcheck(ops.allgather_param.default, (placeholder, GRAPH, 3), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(
        ops.allgather_param.default, (placeholder, GRAPH, 3), {"dtype": torch.bfloat16}, test_utils=OPCHECK_UTILS
    )
    out = ops.allgather_param(shard, GRAPH, 3)
    assert torch.equal(out, full)


def test_opcheck_prefetch_params_fused(rt):
    full, shard, _ = _register_z3(3, (5, 3))
    torch.library.opcheck(ops.prefetch_params_fused.default, (GRAPH, [shard], [3]), test_utils=OPCHECK_UTILS)
    assert runtime.is_gathered(3)


def test_opcheck_wait_allgather(rt):
    full, shard, _ = _register_z3(3, (5, 3))
    out = ops.allgather_param(shard, GRAPH, 3)
    torch.library.opcheck(ops.wait_allgather.default, (out, GRAPH, 3), test_utils=OPCHECK_UTILS)


def test_opcheck_release_param(rt):
    # A persistent param: opcheck calls the op several times, and releasing a persistent param is
    # a complete (non-freeing) episode every time, so the call count does not matter.
    full, shard, _ = _register_z3(3, (5, 3), persistent=True)
    out = ops.wait_allgather(ops.allgather_param(shard, GRAPH, 3), GRAPH, 3)
    consumer = out * 2
    torch.library.opcheck(ops.release_param.default, (consumer, GRAPH, 3, 1), test_utils=OPCHECK_UTILS)
    assert torch.equal(out, full)


def test_opcheck_reduce_grad_and_end_backward(rt):
    _register_z3(3, (5, 3))
    runtime.start_backward(True)
    grad = torch.randn(5, 3)
    torch.library.opcheck(ops.reduce_grad.default, (grad, GRAPH, 3), test_utils=OPCHECK_UTILS)
    dep = ops.reduce_grad(grad, GRAPH, 3)
    torch.library.opcheck(ops.end_backward.default, ([dep], GRAPH, True), test_utils=OPCHECK_UTILS)
    assert runtime.pending_reduce_tasks() == 0


def test_opcheck_free_tensors(rt):
    # Only tensors below the threshold: test_schema compares every input before/after the call,
    # and reading a tensor whose storage was freed (0 bytes) is undefined (it segfaults). Freeing
    # itself is covered by test_lifecycle.py::test_free_tensors_threshold_in_bytes.
    #
    # opcheck runs the op on copies made by clone_input, which places each tensor inside a larger
    # storage (offset and padding). The threshold is on the tensor's byte size, so those copies
    # must be kept too; checked directly first, since a wrongly freed input would make
    # SchemaCheckMode read freed memory and kill the test process instead of failing.
    base = torch.randn(100)  # 400 B storage
    view = base[10:14]  # a 16 B tensor in it
    ops.free_tensors([view])
    kept = base.untyped_storage().nbytes()  # an int: a failing assert must not print freed tensors
    del base, view
    assert kept == 400, "free_tensors freed a 16-byte tensor (threshold 64 B) because its storage is larger"
    small = [torch.randn(4), torch.ones(8, dtype=torch.int8)]
    torch.library.opcheck(ops.free_tensors.default, (small,), test_utils=OPCHECK_UTILS)
    sizes = [t.untyped_storage().nbytes() for t in small]
    assert all(n > 0 for n in sizes), sizes


def test_end_backward_without_tensor_deps(rt):
    """A backward graph's dependency list can be empty at run time; the op must still dispatch
    (DeepSpeed bound end_backward to the Undefined key for this)."""
    _register_z3(3, (5, 3))
    runtime.start_backward(True)
    ops.end_backward([], GRAPH, True)
    assert runtime.pending_reduce_tasks() == 0


# ----------------------------------------------------------------------------------------------
# fake / meta kernels
# ----------------------------------------------------------------------------------------------


def test_fake_allgather_uses_shard_dtype(rt):
    """Without a dtype the fake result has the shard's dtype (bf16), not float32 (DeepSpeed's fake
    kernel always answered float32, so a traced bf16 model saw fp32 parameters)."""
    _register_z3(4, (3, 5), dtype=torch.bfloat16)
    with FakeTensorMode():
        placeholder = make_placeholder((3, 5), torch.bfloat16, "cpu")
        out = ops.allgather_param(placeholder, GRAPH, 4)
        assert tuple(out.shape) == (3, 5)
        assert out.dtype == torch.bfloat16
        up = ops.allgather_param(placeholder, GRAPH, 4, torch.float32)
        assert tuple(up.shape) == (3, 5) and up.dtype == torch.float32
    assert not runtime.is_gathered(4), "the fake kernel started a real gather"


def test_meta_allgather_uses_shard_dtype(rt):
    _register_z3(4, (3, 5), dtype=torch.bfloat16)
    out = ops.allgather_param(torch.empty(3, 5, dtype=torch.bfloat16, device="meta"), GRAPH, 4)
    assert out.device.type == "meta" and tuple(out.shape) == (3, 5) and out.dtype == torch.bfloat16
    assert not runtime.is_gathered(4)


def test_fake_allgather_with_dtype_needs_no_runtime():
    """With a dtype named (what the ZeRO-3 pass and the prefetch planner emit), the fake result
    comes from the inputs alone: tracing works without a runtime or a registered parameter."""
    runtime.cleanup()
    with FakeTensorMode():
        out = ops.allgather_param(make_placeholder((4, 6), torch.float32, "cpu"), GRAPH, 999, torch.bfloat16)
        assert tuple(out.shape) == (4, 6) and out.dtype == torch.bfloat16
    assert not runtime.is_initialized()


def test_fake_allgather_unknown_id_raises(rt):
    _register_z3(4, (3, 5))
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match="unknown ds id 12345: no parameter with this id is registered"):
            ops.allgather_param(torch.empty(0), GRAPH, 12345)


def test_meta_reduce_grad_is_empty(rt):
    _register_z3(3, (5, 3))
    runtime.start_backward(True)
    out = ops.reduce_grad(torch.empty(5, 3, dtype=torch.bfloat16, device="meta"), GRAPH, 3)
    assert out.device.type == "meta" and out.numel() == 0 and out.dtype == torch.bfloat16
    with FakeTensorMode():
        out = ops.reduce_grad(torch.empty(5, 3), GRAPH, 3)
        assert out.numel() == 0 and out.dtype == torch.float32
    assert runtime.pending_reduce_tasks() == 0, "a fake/meta reduce_grad queued a real reduction"


def test_fake_kernels_have_no_side_effects(rt):
    """Tracing must not touch runtime state: no gather, no release countdown, no freeing."""
    full, shard, _ = _register_z3(3, (5, 3))
    with FakeTensorMode():
        p = make_placeholder((5, 3), torch.float32, "cpu")
        ops.prefetch_params_fused(GRAPH, [p], [3])
        g = ops.allgather_param(p, GRAPH, 3)
        w = ops.wait_allgather(g, GRAPH, 3)
        assert tuple(w.shape) == (5, 3)
        r = ops.release_param(w, GRAPH, 3, 1)
        assert tuple(r.shape) == (5, 3)
        big = torch.empty(1024)
        ops.free_tensors([big])
        ops.end_backward([r], GRAPH, True)
    assert not runtime.is_gathered(3)
    # The release countdown was not armed by the fake release: a real episode with 2 users
    # frees only at its second release.
    out = ops.wait_allgather(ops.allgather_param(shard, GRAPH, 3), GRAPH, 3)
    assert torch.equal(out, full)
    ops.release_param(out, GRAPH, 3, 2)
    first = out.untyped_storage().nbytes()
    ops.release_param(out, GRAPH, 3, 2)
    second = out.untyped_storage().nbytes()
    del out  # (never printed by a failing assert: its storage may be freed)
    assert first > 0, "the first of two releases freed: the fake release armed the countdown"
    assert second == 0, "the second of two releases did not free"


# ----------------------------------------------------------------------------------------------
# slot overloads: the graph instance (a zero-dimensional int64 CPU tensor) and a slot name the
# parameter; slot i is the i-th id register_graph was given.
# ----------------------------------------------------------------------------------------------


def _register_two_in_slots(rt_graph=GRAPH):
    """ds ids 5 and 3 in graph ``rt_graph``, registered in slot order [5, 3]."""
    full5, shard5, _ = _register_z3(5, (2, 4))
    full3, shard3, _ = _register_z3(3, (5, 3))
    runtime.register_graph(rt_graph, [5, 3], 3)
    return torch.tensor(rt_graph, dtype=torch.int64), (full5, shard5), (full3, shard3)


def test_slot_ops_resolve_the_instance_and_slot(rt):
    graph, (full5, shard5), (full3, shard3) = _register_two_in_slots()
    placeholder = readable_placeholder(full3.shape, full3.dtype, full3.device)
    torch.library.opcheck(ops.allgather_param.slot, (placeholder, graph, 1), {"dtype": torch.float32},
                          test_utils=OPCHECK_UTILS)
    out = ops.wait_allgather.slot(ops.allgather_param.slot(shard3, graph, 1, dtype=torch.float32), graph, 1)
    assert torch.equal(out, full3), "slot 1 must be ds id 3"
    torch.library.opcheck(ops.wait_allgather.slot, (out, graph, 1), test_utils=OPCHECK_UTILS)
    ops.release_param.slot(out * 1, graph, 1, 1)
    assert not runtime.is_gathered(3)
    torch.library.opcheck(ops.prefetch_params_fused.slot, ([shard5], graph, [0]), {"dtypes": [torch.float32]},
                          test_utils=OPCHECK_UTILS)
    assert runtime.is_gathered(5) and not runtime.is_gathered(3)
    runtime.start_backward(True)
    grad = torch.randn(5, 3)
    torch.library.opcheck(ops.reduce_grad.slot, (grad, graph, 1), test_utils=OPCHECK_UTILS)
    dep = ops.reduce_grad.slot(grad, graph, 1)
    torch.library.opcheck(ops.end_backward.slot, ([dep], graph, True), test_utils=OPCHECK_UTILS)
    assert runtime.pending_reduce_tasks() == 0
    assert runtime.graph_param_ids(GRAPH) == [5, 3]


def test_slot_ops_reject_bad_instances_and_slots(rt):
    graph, _, (full3, shard3) = _register_two_in_slots()
    with pytest.raises(RuntimeError, match="slot 2 is out of range for graph 7, which has 2 parameter slots"):
        ops.allgather_param.slot(shard3, graph, 2, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="zero-dimensional int64 CPU tensor"):
        ops.allgather_param.slot(shard3, torch.tensor([GRAPH]), 1, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="zero-dimensional int64 CPU tensor"):
        ops.reduce_grad.slot(torch.randn(5, 3), torch.tensor(float(GRAPH)), 1)
    with pytest.raises(RuntimeError, match="graph id 99 is not registered"):
        ops.wait_allgather.slot(shard3, torch.tensor(99), 1)
