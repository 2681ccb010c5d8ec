"""Reading and writing sharded state while it is offloaded (``Sharding.state_access``,
offload/opt_states.py): checkpoints, full state dicts, Hugging Face export and loading read the
host copies of offloaded units and write into them, never bringing every unit back to the device.

On CPU the "device" copy and the host buffer are distinct storages (the device storage of an
offloaded unit is really emptied), so a read that went to the device copy would fail, and one
that brought units back is seen by the reload counter (``_reload`` of a unit on the host). Every
comparison is bitwise: offload only moves bytes, so a checkpoint, a state dict or an export of
an offloading engine is the one of the same training without offload, and a run resumed into an
offloading engine continues exactly like one resumed without offload.

Cases: ZeRO-3 with ``offload_optimizer`` and ``offload_param`` (masters and moments on the host,
the step streaming in sub-groups), ZeRO-2 with ``offload_optimizer`` (master partitions and
moments on the host). The GPU test (marked ``gpu``) checks that saving and loading an offloaded
ZeRO-3 engine holds at most the largest unit (and a stated margin) above the memory held before.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _harness import multiproc
from _harness.multiproc import run_distributed
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model, make_optimizer

pytestmark = pytest.mark.world_size(2)  # the world size in every test id (conftest.py)

CASES = {
    "z3": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
           # Several sub-groups: the step streams (before_sub_group / after_sub_group).
           "sub_group_size": 40},
    "z2": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}

cpu_only = pytest.mark.skipif(multiproc.test_device_type() == "cuda",
                              reason="bitwise CPU parity; the gpu variant is test_gpu_save_load_memory")


def _config(case: str, offload: bool) -> dict:
    z = {"reduce_bucket_size": 48, "stage3_param_persistence_threshold": 10}
    for key, value in CASES[case].items():
        if offload or key in ("stage", "sub_group_size"):
            z[key] = value
    return {"zero_optimization": z}


def _engine(ctx, case: str, offload: bool, seed: int = 1234):
    import deepcompile

    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    if seed != 1234:  # other initial values: what a load must overwrite
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    return deepcompile.initialize(model, make_optimizer(model.parameters()), _config(case, offload))


def _train(engine, ctx, steps: int):
    """``steps`` optimizer steps from the engine's current micro-step; the global mean losses."""
    n = GLOBAL_BATCH // ctx.world_size
    losses = []
    for _ in range(steps):
        x, y = batch("mlp", engine.micro_steps, device=ctx.device)
        loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return losses


class ReloadCounter:
    """Counts units brought back to the device (``UnitCopies.reload`` of a unit on the host)."""

    def __init__(self, offload):
        self.count = 0
        original = offload.copies.reload

        def counting(unit):
            self.count += unit.on_host
            return original(unit)

        offload.copies.reload = counting


def _offloaded(engine):
    """The offloaded units, each checked to have an empty device storage."""
    away = engine.offload.offloaded_units()
    assert away, "nothing is offloaded between steps"
    for u in away:
        assert u.device_bytes.untyped_storage().nbytes() == 0, engine.offload._label(u)
    return away


def _read_dcp(path: str) -> dict:
    """Every entry of a DCP checkpoint, read back with torch.distributed.checkpoint alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
           for k, md in stored.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(path), no_dist=True,
             planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    return out


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "numpy":  # the numpy generator's state (rng/<rank>)
        import numpy

        assert numpy.array_equal(a, b), where
    else:
        assert a == b, (where, a, b)


def _read_safetensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


# ---- save, full_state_dict and export of an offloaded engine ------------------------------------


def _save_body(ctx, case: str, root: str):
    steps = 3
    base = _engine(ctx, case, offload=False)
    _train(base, ctx, steps)
    base.save_checkpoint(os.path.join(root, "base"), tag="t")
    base_rank0 = base.full_state_dict()
    base_all = base.full_state_dict(all_ranks=True)
    base.save_hf(os.path.join(root, "base_hf"))
    base.destroy()

    engine = _engine(ctx, case, offload=True)
    _train(engine, ctx, steps)
    away = _offloaded(engine)
    assert any(u.what == "fp32 master" for u in away) and any(u.what != "fp32 master" for u in away)
    reloads = ReloadCounter(engine.offload)
    engine.save_checkpoint(os.path.join(root, "offload"), tag="t")
    rank0 = engine.full_state_dict()
    everything = engine.full_state_dict(all_ranks=True)
    engine.save_hf(os.path.join(root, "offload_hf"))
    # Nothing came back: every unit offloaded before is still on the host, device storage empty.
    assert reloads.count == 0, reloads.count
    assert _offloaded(engine) == away
    _assert_same(everything, base_all, "full_state_dict(all_ranks=True)")
    _assert_same(rank0, base_rank0, "full_state_dict()")
    if ctx.rank == 0:
        got, want = _read_dcp(os.path.join(root, "offload", "t")), _read_dcp(os.path.join(root, "base", "t"))
        assert any(k.startswith("optim/") for k in want) and any(k.startswith("model/") for k in want)
        _assert_same(got, want, "checkpoint")
        got, want = _read_safetensors(os.path.join(root, "offload_hf")), _read_safetensors(os.path.join(root, "base_hf"))
        assert want
        _assert_same(got, want, "save_hf")
    dist.barrier()
    # Training goes on from the host copies, still offloading.
    _train(engine, ctx, 1)
    assert _offloaded(engine)
    engine.destroy()


@cpu_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_save_full_state_dict_and_export_read_the_host_copies(tmp_path, case):
    run_distributed(_save_body, 2, args=(case, str(tmp_path)), timeout=300)


# ---- load into an offloaded engine, then train on -------------------------------------------------


def _write_checkpoint_body(ctx, case: str, root: str, steps: int):
    engine = _engine(ctx, case, offload=True)
    _train(engine, ctx, steps)
    engine.save_checkpoint(root, tag="saved")
    engine.destroy()


def _check_window(engine):
    """While fresh state replaces the old one (reset_optimizer_state), no planned-out state unit
    stays on the device beyond the one being taken over: the load's device window is one unit."""
    off = engine.offload
    access = off.access  # the stage's Sharding.state_access (offload/opt_state_access.py)
    original = access.state_replaced
    calls = []

    def checked(ds_ids):
        original(ds_ids)
        calls.append(list(ds_ids))
        held = [off._label(u) for u in off.units.values()
                if u.planned_out and u.device_bytes.untyped_storage().nbytes() != 0]
        assert not held, held

    access.state_replaced = checked
    return calls


def _resume_body(ctx, case: str, root: str, warm: bool, steps: int):
    # Without offload, resumed from the checkpoint: the expected continuation.
    base = _engine(ctx, case, offload=False, seed=99)
    base.load_checkpoint(root)
    base_losses = _train(base, ctx, steps)
    base_params = base.full_state_dict(all_ranks=True)
    base.destroy()

    engine = _engine(ctx, case, offload=True, seed=99)
    if warm:
        # State exists and is offloaded already: the load replaces it in the host copies.
        _train(engine, ctx, 2)
        away = _offloaded(engine)
    calls = _check_window(engine)
    reloads = ReloadCounter(engine.offload)
    engine.load_checkpoint(root)
    assert reloads.count == 0, reloads.count
    assert calls, "the load replaced no optimizer state"
    # Every state unit the load created is on the host (offloaded one at a time), and, in a warm
    # engine, every unit offloaded before still is.
    state = [u for u in engine.offload.units.values() if u.what != "fp32 master"]
    assert state and all(u.on_host for u in state), [engine.offload._label(u) for u in state if not u.on_host]
    if warm:
        assert {u.storage_key for u in _offloaded(engine)} >= {u.storage_key for u in away if u.what == "fp32 master"}
    losses = _train(engine, ctx, steps)
    params = engine.full_state_dict(all_ranks=True)
    assert _offloaded(engine)
    engine.destroy()
    assert losses == base_losses, (losses, base_losses)
    _assert_same(params, base_params, "parameters after resuming")


RESUMES = [(case, saved, loaded, warm) for case in sorted(CASES)
           for saved, loaded, warm in ((2, 2, True), (2, 1, False), (1, 2, True))]


@cpu_only
@pytest.mark.parametrize("case,saved,loaded,warm", RESUMES,
                         ids=[f"{c}-ws{s}-ws{l}-{'warm' if w else 'fresh'}" for c, s, l, w in RESUMES])
def test_load_into_offloaded_engine_then_train(tmp_path, case, saved, loaded, warm):
    root = str(tmp_path / "ckpt")
    run_distributed(_write_checkpoint_body, saved, args=(case, root, 3), timeout=300)
    run_distributed(_resume_body, loaded, args=(case, root, warm, 3), timeout=300)


def _hf_load_body(ctx, case: str, folder: str):
    # Export of a trained engine without offload, loaded into a trained offloading engine: the
    # weights land in the host copies of the masters, and training goes on as it does without.
    base = _engine(ctx, case, offload=False)
    _train(base, ctx, 2)
    base.save_hf(folder)
    base.destroy()

    import deepcompile

    runs = []
    for offload in (False, True):
        engine = _engine(ctx, case, offload=offload, seed=99)
        _train(engine, ctx, 2)
        if offload:
            away = _offloaded(engine)
            reloads = ReloadCounter(engine.offload)
        deepcompile.load_hf_weights(engine, folder)
        if offload:
            assert reloads.count == 0 and _offloaded(engine) == away
        loaded = engine.full_state_dict(all_ranks=True)
        runs.append((loaded, _train(engine, ctx, 2), engine.full_state_dict(all_ranks=True)))
        engine.destroy()
    exported = _read_safetensors(folder)
    for key, value in exported.items():
        assert torch.equal(runs[1][0][key], value), key
    _assert_same(runs[1], runs[0], "after load_hf_weights")


@cpu_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_load_hf_weights_into_offloaded_engine(tmp_path, case):
    run_distributed(_hf_load_body, 2, args=(case, str(tmp_path / "hf")), timeout=300)


# ---- the streamed step: each sub-group's state written back right after it steps ---------------


def _watch_sub_groups(engine, log):
    """After every after_sub_group: the per-element optimizer state of that sub-group's parameters
    has an empty device storage (it went to the host right after stepping, not at after_step)."""
    off, sharding = engine.offload, engine.sharding
    original = off.after_sub_group
    opt = sharding.optimizer.optimizer

    def checked(index, groups):
        original(index, groups)
        log.append(len(groups))
        for ds_id in groups[index]:
            master = sharding.params[ds_id].master
            for key, value in opt.state.get(master, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert value.untyped_storage().nbytes() == 0, (sharding.params[ds_id].name, key, index)

    off.after_sub_group = checked


def _discover_counter(engine):
    off = engine.offload
    original = off.discover
    calls = []

    def counted(only_ids=None):
        calls.append(only_ids)
        return original(only_ids)

    off.discover = counted
    return calls


def _sub_group_body(ctx, root: str):
    saver = _engine(ctx, "z3", offload=True)
    _train(saver, ctx, 2)
    saver.save_checkpoint(root, tag="saved")
    saver.destroy()

    engine = _engine(ctx, "z3", offload=True, seed=99)
    log = []
    _watch_sub_groups(engine, log)
    discovers = _discover_counter(engine)
    # The first step creates the state: after_sub_group must find it (new ids) to write it back.
    _train(engine, ctx, 1)
    assert log and log[0] > 1, log  # the step really streamed in several sub-groups
    assert any(c is not None for c in discovers), discovers
    # A steady step: nothing new, after_sub_group discovers nothing (after_step's check only).
    discovers.clear()
    _train(engine, ctx, 1)
    assert discovers == [None], discovers
    # Loaded state replaces the storages: the next step still writes each sub-group's back.
    engine.load_checkpoint(root)
    discovers.clear()
    log.clear()
    _train(engine, ctx, 1)
    assert log, "the step after the load did not stream"
    assert any(c is not None for c in discovers), discovers  # the replaced storages were looked for again
    discovers.clear()
    _train(engine, ctx, 1)
    assert discovers == [None], discovers
    engine.destroy()


@cpu_only
def test_streamed_step_writes_back_new_and_loaded_state_per_sub_group(tmp_path):
    run_distributed(_sub_group_body, 2, args=(str(tmp_path / "ckpt"),), timeout=300)


# ---- GPU: the device memory a save and a load of an offloaded engine take -------------------------

GPU_WIDTH, GPU_DEPTH, GPU_BATCH = 2048, 8, 16
# What a save or a load may allocate on the device beyond the bound below: the small tensors of
# the collectives that agree on the tag, plans and failures (all_gather_object and the like: a few
# KiB each) and DCP's plan exchange. 4 MiB is a quarter of one layer's weight (16 MiB at width
# 2048), so bringing back even one offloaded unit more than allowed fails the test.
GPU_MARGIN = 4 * 2**20


def _gpu_body(ctx, root: str):
    import deepcompile
    from test_gpu_memory import build_model as build_stack, make_batch, make_optimizer as stack_optimizer

    torch._dynamo.reset()
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": GPU_WIDTH * GPU_WIDTH + GPU_WIDTH,
                                 "sub_group_size": GPU_WIDTH * GPU_WIDTH + GPU_WIDTH,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "offload_param": {"device": "cpu", "pin_memory": True}},
           "compile": {"prefetch": False, "selective_gather": False}}
    model = build_stack(GPU_WIDTH, GPU_DEPTH, torch.float32, ctx.device)
    engine = deepcompile.initialize(model, stack_optimizer(model.parameters()), cfg)
    engine.compile(backend="inductor")
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(i):
        x, y = make_batch(i, GPU_BATCH * world, GPU_WIDTH, torch.float32, ctx.device)
        loss = engine(x[rank * GPU_BATCH:(rank + 1) * GPU_BATCH], y[rank * GPU_BATCH:(rank + 1) * GPU_BATCH])
        engine.backward(loss)
        engine.step()
        return loss.detach().cpu()

    for i in range(3):
        step(i)
    units = list(engine.offload.units.values())
    away = sum(u.nbytes for u in units if u.on_host)
    largest = max(u.nbytes for u in units)
    # A load allocates one parameter's fresh state at a time (all its per-element keys together,
    # torch's Adam: exp_avg and exp_avg_sq) and sends it to the host before the next.
    per_param = {}
    for u in units:
        if u.what != "fp32 master":
            for ds_id in u.ds_ids:
                per_param[ds_id] = per_param.get(ds_id, 0) + u.nbytes
    fresh_window = max(per_param.values())
    assert all(u.on_host for u in units), "the test wants everything offloaded"
    assert away > 4 * (fresh_window + GPU_MARGIN), (away, fresh_window)  # a full reload would show
    before = {k: v.clone() for k, v in engine.full_state_dict(all_ranks=True).items()}

    torch.cuda.synchronize(ctx.device)
    held = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    engine.save_checkpoint(root, tag="saved")
    torch.cuda.synchronize(ctx.device)
    save_peak = torch.cuda.max_memory_allocated(ctx.device)
    assert save_peak <= held + largest + GPU_MARGIN, (save_peak, held, largest)

    # Load into the same engine after it trained on (its state differs from the checkpoint).
    after_save = step(3)
    trained = {k: v.clone() for k, v in engine.full_state_dict(all_ranks=True).items()}
    torch.cuda.synchronize(ctx.device)
    held = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    engine.load_checkpoint(root, tag="saved")
    torch.cuda.synchronize(ctx.device)
    load_peak = torch.cuda.max_memory_allocated(ctx.device)
    assert load_peak <= held + fresh_window + GPU_MARGIN, (load_peak, held, fresh_window)
    # The load restored exactly what was saved, and the step after it is the one after the save.
    loaded = engine.full_state_dict(all_ranks=True)
    for key, value in before.items():
        assert torch.equal(loaded[key], value), key
    # Same values and optimizer state, same kernels: the step after the load is the one after the
    # save. Compared at fp32 rounding (CUDA kernels may sum in another order from run to run, see
    # test_checkpoint.RESUME_EXACT); a lost Adam moment moves parameters by ~lr = 1e-3.
    again = step(3)
    torch.testing.assert_close(again, after_save, rtol=1e-6, atol=1e-6)
    retrained = engine.full_state_dict(all_ranks=True)
    for key, value in trained.items():
        torch.testing.assert_close(retrained[key], value, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")
    engine.destroy()
    if rank == 0:
        print(f"offloaded {away} B, largest unit {largest} B, largest fresh state {fresh_window} B; "
              f"save peak - held {save_peak - held} B, "
              f"load peak - held {load_peak - held} B")


@pytest.mark.world_size(multiproc.single_world_size())
@pytest.mark.gpu
def test_gpu_save_load_memory(tmp_path):
    run_distributed(_gpu_body, multiproc.single_world_size(), args=(str(tmp_path / "ckpt"),), timeout=600)
