"""ZeRO-3 parameter offload (``compile.offload_parameters``, ``zero_optimization.offload_param``).

The master shards (the all-gather sources) live in host memory between optimizer steps; the C++
runtime gathers them from there (``runtime.set_host_shard``), and they come back to the device
only for the optimizer step. Parity is bitwise against the same engine without offload: the
gathers read the same bytes from another place, and on CPU the copies are synchronous, so losses
and parameters must be identical. Each run is also checked against single-process training at
the parity suites' tolerances, so a bug that broke both runs alike would still show.

Between steps every master shard must have an empty device storage while the runtime holds a host
shard for it; the optimizer's state stays on the device unless optimizer-state offload asks
otherwise. The GPU test (marked ``gpu``) checks parity and that device memory between steps drops
by the masters' bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness import multiproc, offload_gpu
from _harness.multiproc import run_distributed
from _harness.runtime_reference import CONFIG
from _harness.parity_cases import MLP, assert_parity, build_model, make_optimizer, run_steps, train_reference
from test_zero3_parity import BF16_TOL, FP32_TOL, INDUCTOR_TOL

pytestmark = pytest.mark.world_size(2)  # the world size in every test id (conftest.py)

ON = {
    "offload_parameters": {"compile": {"offload_parameters": True}},
    "offload_param": {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True}}},
}


def _config(param_offload=None, gas=1, extra=None):
    cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 48, "stage3_param_persistence_threshold": 10},
           "gradient_accumulation_steps": gas}
    for part in (ON.get(param_offload, {}), extra or {}):
        for section, values in part.items():
            cfg.setdefault(section, {}).update(values)
    return cfg


def _train(ctx, name, cfg, backend, steps, gas=1, between_steps=None, dtype=torch.float32):
    import deepcompile

    torch._dynamo.reset()
    model = build_model(name, dtype=dtype, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
    if backend is not None:
        engine.compile(backend=backend)

    def after_step(engine, step):
        if between_steps is not None and (step + 1) % gas == 0:
            between_steps(engine, step)

    return run_steps(engine, name, steps, ctx.device, dtype=dtype, after_step=after_step), engine


def _check_between_steps(state_offloaded: bool):
    """After every optimizer step: each master shard's device storage is empty and the runtime
    gathers it from a host shard of the same values; the optimizer's state is offloaded exactly
    when optimizer-state offload is on too."""
    from deepcompile import runtime
    from deepcompile.offload.opt_states import MASTER

    def check(engine, step):
        off = engine.offload
        assert off is not None and off.plan is not None
        masters = [u for u in off.units.values() if u.what == MASTER]
        # Every parameter of the model has a shard on every rank (the MLP's smallest has 5
        # elements, more than the ranks), so every parameter has a master unit.
        assert sorted(i for u in masters for i in u.ds_ids) == sorted(engine.sharding.ds_id_of.values())
        for u in masters:
            assert u.planned_out and u.on_host and not u.early, off._label(u)
            assert u.device_bytes.untyped_storage().nbytes() == 0, off._label(u)
            for ds_id in u.ds_ids:
                shard = runtime.registered_shard(ds_id)
                assert shard.untyped_storage().nbytes() == 0, ds_id  # the gather source itself
                host = runtime.host_shard(ds_id)
                assert host is not None and host.device.type == "cpu" and host.numel() == shard.numel()
                assert host.untyped_storage().data_ptr() == u.host.untyped_storage().data_ptr()
        state = [u for u in off.units.values() if u.what != MASTER]
        assert state, "the optimizer has no per-element state to check"
        for u in state:
            assert u.planned_out == state_offloaded and u.on_host == state_offloaded, off._label(u)
        report = engine.schedule_report()["optimizer_state_offload"]
        assert report["offloaded_bytes"] == sum(u.nbytes for u in off.units.values() if u.planned_out)
        assert "offload_param" in report["enabled_by"] or "offload_parameters" in report["enabled_by"]

    return check


def _parity_body(ctx, name, backend, key, steps, gas=1, extra=None):
    bf16 = bool(extra and extra.get("bf16", {}).get("enabled"))
    dtype = torch.bfloat16 if bf16 else torch.float32
    base, engine = _train(ctx, name, _config(None, gas, extra), backend, steps, dtype=dtype)
    engine.destroy()
    state_offloaded = bool(extra and ("offload_optimizer" in extra.get("zero_optimization", {})
                                      or extra.get("compile", {}).get("offload_opt_states")))
    got, engine = _train(ctx, name, _config(key, gas, extra), backend, steps, gas,
                         between_steps=_check_between_steps(state_offloaded), dtype=dtype)
    # Training left the masters on the host; the full state dict above was gathered from there.
    assert engine.offload.offloaded_units()
    if name == "mlp":
        # The MLP's fc2.bias is persistent (stage3_param_persistence_threshold 10): re-gathered from
        # its host shard after every step.
        assert engine.sharding.persistent_ids()
    if extra and extra.get("compile", {}).get("prefetch"):
        # The profile-guided passes really applied: the later steps gathered in prefetch groups.
        report = engine.schedule_report()
        assert "prefetch" in report["entry"], report["entry"]
        assert any(g["prefetch"] for g in report["graphs"]), report["graphs"]
    engine.destroy()
    # Bitwise: the gathers read the same bytes from the host.
    assert got.losses == base.losses, (got.losses, base.losses)
    for k, value in base.params.items():
        assert torch.equal(got.params[k], value), k
    ref = train_reference(name, steps, gas=gas, device=ctx.device)
    assert_parity(got, ref, **(BF16_TOL if bf16 else INDUCTOR_TOL if backend == "inductor" else FP32_TOL))


cpu_only = pytest.mark.skipif(multiproc.test_device_type() == "cuda",
                              reason="bitwise CPU parity; the gpu variant is test_param_offload_gpu_*")


@cpu_only
@pytest.mark.parametrize("world", [1, 2], ids=multiproc.ws_id)
@pytest.mark.parametrize("key", sorted(ON))
def test_param_offload_parity_eager(world, key):
    run_distributed(_parity_body, world, args=("mlp", "eager", key, 4), timeout=300)


@cpu_only
def test_param_offload_parity_inductor():
    run_distributed(_parity_body, 2, args=("mlp", "inductor", "offload_param", 4), timeout=300)


@cpu_only
def test_param_offload_parity_engine_without_compile_and_accumulation():
    run_distributed(_parity_body, 2, args=("mlp", None, "offload_parameters", 8), kwargs={"gas": 2})


@cpu_only
def test_param_offload_parity_with_gradient_accumulation_compiled():
    run_distributed(_parity_body, 2, args=("mlp", "eager", "offload_param", 8), kwargs={"gas": 2})


@cpu_only
def test_param_offload_parity_with_prefetch_and_selective_gather():
    # After one warm-up step the profile-guided passes (prefetch, selective gather) apply, so the
    # later steps gather through prefetch groups and kept parameters from host shards.
    extra = {"compile": {"warmup_steps": 1, "prefetch": True, "selective_gather": True}}
    run_distributed(_parity_body, 2, args=("llama", "eager", "offload_parameters", 4), kwargs={"extra": extra},
                    timeout=300)


@cpu_only
def test_param_offload_parity_bf16():
    # bf16 parameters gathered from fp32 host shards: the cast happens after the host read.
    run_distributed(_parity_body, 2, args=("mlp", "eager", "offload_parameters", 4),
                    kwargs={"extra": {"bf16": {"enabled": True}}})


@cpu_only
def test_param_offload_together_with_optimizer_state_offload():
    extra = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    run_distributed(_parity_body, 2, args=("mlp", "eager", "offload_param", 4), kwargs={"extra": extra})


def _state_access_body(ctx):
    from deepcompile import runtime
    from _harness.parity_cases import GLOBAL_BATCH, batch

    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world

    def one_more_step(e):
        a, b = batch("mlp", 3, device=ctx.device)
        e.backward(e(a[rank * n: (rank + 1) * n], b[rank * n: (rank + 1) * n]))
        e.step()

    # One engine at a time: engines share the process's runtime, whose registry is by ds id.
    _, engine = _train(ctx, "mlp", _config(None), "eager", 3)
    base_shards = {s.ds_id: s.local.clone() for s in engine.sharding.shards()}
    one_more_step(engine)
    base_state = engine.full_state_dict(all_ranks=True)
    engine.destroy()

    _, engine = _train(ctx, "mlp", _config("offload_param"), "eager", 3)
    assert engine.offload.offloaded_units(), "nothing offloaded between steps"
    away = engine.offload.offloaded_units()
    # Reading sharded state (checkpoints, weight export) between steps reads the masters' host
    # copies, which the gathers keep reading from: nothing comes back to the device.
    for s in engine.sharding.shards():
        assert torch.equal(s.local, base_shards[s.ds_id]), s.name
        host = runtime.host_shard(s.ds_id)
        assert host is not None and s.local.untyped_storage().data_ptr() == host.untyped_storage().data_ptr(), s.name
    assert engine.offload.offloaded_units() == away
    # Training on continues identically, and the next step offloads again.
    one_more_step(engine)
    assert engine.offload.offloaded_units()
    assert all(runtime.host_shard(i) is not None for i in engine.sharding.ds_id_of.values())
    offloaded_state = engine.full_state_dict(all_ranks=True)
    for key, value in base_state.items():
        assert torch.equal(offloaded_state[key], value), key
    # Rank-0 state dicts read the shards (gather_full.py) from the host copies, one at a time.
    away = engine.offload.offloaded_units()
    rank0 = engine.full_state_dict()
    if rank == 0:
        for key, value in base_state.items():
            assert torch.equal(rank0[key], value), key
    assert engine.offload.offloaded_units() == away
    engine.destroy()


@cpu_only
def test_reading_sharded_state_between_steps():
    run_distributed(_state_access_body, 2)


def _checkpoint_body(ctx, directory):
    import deepcompile
    from _harness.parity_cases import GLOBAL_BATCH, batch

    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world

    def engine_for(key):
        torch._dynamo.reset()
        model = build_model("mlp", device=ctx.device)
        engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _config(key))
        engine.compile(backend="eager")
        return engine

    def train(engine, steps):
        losses = []
        for step in steps:
            a, b = batch("mlp", step, device=ctx.device)
            loss = engine(a[rank * n: (rank + 1) * n], b[rank * n: (rank + 1) * n])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        return losses

    engine = engine_for(None)
    train(engine, range(3))
    base_losses = train(engine, range(3, 5))
    base_state = engine.full_state_dict(all_ranks=True)
    engine.destroy()

    # Saved while the masters are on the host, loaded into an engine that offloads them again.
    engine = engine_for("offload_param")
    train(engine, range(3))
    assert engine.offload.offloaded_units()
    engine.save_checkpoint(directory)
    engine.destroy()
    engine = engine_for("offload_param")
    engine.load_checkpoint(directory)
    losses = train(engine, range(3, 5))
    assert engine.offload.offloaded_units()
    state = engine.full_state_dict(all_ranks=True)
    engine.destroy()
    assert all(torch.equal(a, b) for a, b in zip(losses, base_losses)), (losses, base_losses)
    for key, value in base_state.items():
        assert torch.equal(state[key], value), key


@cpu_only
def test_checkpoint_round_trip_with_parameter_offload(tmp_path):
    run_distributed(_checkpoint_body, 2, args=(str(tmp_path / "ckpt"),))


# ---- frozen parameters: written to the host once --------------------------------------------


def _spy_on_write_backs(off):
    """Record the host buffer (its address) of every write-back of ``off``'s units."""
    written = []
    copy = off.copies.lanes.offload

    def spy(host, dev):
        written.append(host.data_ptr())
        return copy(host, dev)

    off.copies.lanes.offload = spy
    return written


def _frozen_body(ctx, key):
    """A frozen parameter's shard never changes, so after initialize it is never written to the
    host again: not at a step, and not after ``materialize`` brought every unit back (its host
    copy is still current). Training stays bitwise the run without offload."""
    from deepcompile.offload.opt_states import MASTER

    base, engine = _train(ctx, "lora", _config(None), "eager", 6)
    engine.destroy()
    frozen_names = {"fc1.weight", "fc1.bias", "fc2.weight"}
    seen = {}

    def check(engine, step):
        off = engine.offload
        if step == 0:
            seen["written"] = _spy_on_write_backs(off)
            seen["host"] = {id(u): u.host.clone() for u in off.units.values() if u.what == MASTER}
        masters = [u for u in off.units.values() if u.what == MASTER]
        frozen = [u for u in masters if off.param_names[u.ds_ids[0]] in frozen_names]
        trainable = [u for u in masters if u not in frozen]
        assert len(frozen) == len(frozen_names) and len(trainable) == 3, [off._label(u) for u in masters]
        written = seen["written"]
        if step > 0:
            # This step wrote back exactly the masters it updated (Adam's state stays resident).
            assert sorted(written) == sorted(u.host.data_ptr() for u in trainable), step
        for u in frozen:
            assert u.on_host and u.device_bytes.untyped_storage().nbytes() == 0, off._label(u)
            assert torch.equal(u.host, seen["host"][id(u)]), off._label(u)
        written.clear()
        if step == 2:
            # Everything back on the device (gathers read the device copies): the next write-back
            # still copies only the updated masters; the frozen ones are freed without a copy.
            off.materialize()
            assert not off.offloaded_units()

    got, engine = _train(ctx, "lora", _config(key), "eager", 6, between_steps=check)
    engine.destroy()
    assert got.losses == base.losses, (got.losses, base.losses)
    for k, value in base.params.items():
        assert torch.equal(got.params[k], value), k
    assert_parity(got, train_reference("lora", 6, device=ctx.device), **FP32_TOL)


@cpu_only
@pytest.mark.parametrize("key", sorted(ON))
def test_frozen_shards_are_not_written_back(key):
    run_distributed(_frozen_body, 2, args=(key,))


# ---- host buffers only for what is offloaded ---------------------------------------------------


class LateBranchMLP(MLP):
    """The MLP plus a branch the forward takes only once ``use_late`` is set: its parameters get
    their first gradient (and optimizer state) at a later step, where the plan is made again."""

    def __init__(self):
        super().__init__()
        self.late = torch.nn.Linear(7, 5)
        self.use_late = False

    def forward(self, x, y):
        out = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        if self.use_late:
            out = out + self.late(x)
        return ((out - y) ** 2).mean()


def _train_late_branch(ctx, cfg, steps, late, between_steps=None):
    """Trains without compile (the branch switches without a recompile); from micro-step ``late``
    on the forward takes the branch."""
    import deepcompile

    torch.manual_seed(1234)
    model = LateBranchMLP().to(ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)

    def after_step(engine, step):
        if between_steps is not None:
            between_steps(engine, step)
        model.use_late = step + 1 >= late

    return run_steps(engine, "mlp", steps, ctx.device, after_step=after_step), engine


def _resident_hosts_body(ctx):
    """Under a budget that keeps some units on the device, their host buffers (parameter
    offload's masters go to the host at initialize; state a streamed step creates is written back
    provisionally) are freed once the plan keeps them: host memory holds the offloaded units only.
    A later plan (new optimizer state) that offloads a released unit again gives it a new buffer,
    and training stays bitwise the run without offload."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from deepcompile import runtime
    from deepcompile.offload import device_memory, host_memory
    from deepcompile.offload.opt_states import MASTER

    saved = device_memory.peak_allocated, device_memory.allocated, host_memory.empty_host
    peak, steps, late = 1 << 20, 6, 3
    try:
        # A CPU device reads no memory: a forward/backward peak far above the step's floor, so the
        # plan's limit is the budget less this peak.
        device_memory.peak_allocated = lambda device: peak
        device_memory.allocated = lambda device: 0
        _, engine = _train_late_branch(ctx, _config("offload_parameters"), 1, late)
        masters = [u.nbytes for u in engine.offload.units.values() if u.what == MASTER]
        state = sum(u.nbytes for u in engine.offload.units.values() if u.what != MASTER)
        engine.destroy()
        base, engine = _train_late_branch(ctx, _config(None), steps, late)
        engine.destroy()

        made = []  # every host buffer offload allocates, weakly

        def empty_host(nbytes, pin):
            buffer = saved[2](nbytes, pin)
            made.append(StorageWeakRef(buffer.untyped_storage()))
            return buffer

        host_memory.empty_host = empty_host
        # Room for everything but the largest master: it alone is offloaded (optimizer-state
        # offload is off, so the masters are what can go).
        budget = peak + state + sum(masters) - max(masters)
        seen = {}

        def check(engine, step):
            off = engine.offload
            if ctx.device.type == "cuda":
                # A released buffer waits for events of the copies queued before the release
                # (offload/host_release.py); once they have run, the next poll drops it.
                torch.cuda.synchronize()
                off.copies.releases.poll()
                assert off.copies.releases.nbytes == 0, step
            units = list(off.units.values())
            out = [u for u in units if u.planned_out]
            kept = [u for u in units if not u.planned_out]
            assert out and any(u.what == MASTER for u in kept), [(off._label(u), u.planned_out) for u in units]
            for u in kept:
                assert u.host is None and u.device_bytes.untyped_storage().nbytes() == u.nbytes, off._label(u)
                if u.what == MASTER:
                    assert runtime.host_shard(u.ds_ids[0]) is None, off._label(u)  # gathered on the device
            for u in out:
                assert u.on_host and u.host is not None, off._label(u)
                host = runtime.host_shard(u.ds_ids[0])
                assert host is not None and host.untyped_storage().data_ptr() == u.host.data_ptr(), off._label(u)
            # Freed, not merely forgotten: only the offloaded units' buffers are alive.
            assert sum(not ref.expired() for ref in made) == len(out), step
            assert off.host_bytes() == sum(u.nbytes for u in out), step
            assert engine.schedule_report()["optimizer_state_offload"]["host_buffer_bytes"] == off.host_bytes()
            if step == late:
                # The late branch's state made the plan offload masters it had kept resident.
                again = [u for u in out if u.storage_key in seen["kept"]]
                assert again and all(u.what == MASTER for u in again), [off._label(u) for u in out]
            seen["kept"] = {u.storage_key for u in kept}

        cfg = _config("offload_parameters", extra={"compile": {"memory_budget_bytes": budget}})
        got, engine = _train_late_branch(ctx, cfg, steps, late, between_steps=check)
        engine.destroy()
    finally:
        device_memory.peak_allocated, device_memory.allocated, host_memory.empty_host = saved
    assert got.losses == base.losses, (got.losses, base.losses)
    for k, value in base.params.items():
        assert torch.equal(got.params[k], value), k


@cpu_only
def test_host_buffers_of_resident_units_are_released():
    run_distributed(_resident_hosts_body, 2)


@pytest.mark.world_size(multiproc.single_world_size())
@pytest.mark.gpu
def test_gpu_host_buffers_of_resident_units_are_released():
    # The GPU path of the release: page-locked buffers, freed once the copies that read them ran.
    run_distributed(_resident_hosts_body, multiproc.single_world_size())


def test_host_release_waits_for_its_readers():
    # The GPU path of the release (events of queued copies), with stand-in events on CPU.
    from torch.multiprocessing.reductions import StorageWeakRef

    from deepcompile.offload.host_release import HostReleases

    class Event:
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    releases = HostReleases()
    a, b = torch.empty(8, dtype=torch.uint8), torch.empty(3, dtype=torch.uint8)
    readers_a, readers_b = [Event(), Event()], [Event()]
    weak = StorageWeakRef(a.untyped_storage())
    releases.release(a, readers_a)
    releases.release(b, readers_b)
    del a, b
    assert releases.nbytes == 11
    readers_a[0].done = True
    releases.poll()
    assert releases.nbytes == 11 and not weak.expired()  # one reader is still queued
    readers_a[1].done = True
    releases.poll()
    assert releases.nbytes == 3 and weak.expired()
    releases.drain()
    assert releases.nbytes == 0 and readers_b[0].done
    releases.release(torch.empty(4, dtype=torch.uint8), [])  # nothing reads it: dropped at once
    assert releases.nbytes == 0


# ---- the runtime API --------------------------------------------------------------------------


def _runtime_body(ctx):
    from deepcompile import runtime

    ops = torch.ops.dc
    ctx.init_runtime(CONFIG)
    world, rank = ctx.world_size, ctx.rank
    full = torch.arange(10, dtype=torch.float32, device=ctx.device)
    ppr = -(-full.numel() // world)
    shard = torch.zeros(ppr, device=ctx.device)
    piece = full[rank * ppr:(rank + 1) * ppr]
    shard[: piece.numel()] = piece
    runtime.register_z3_params([3], [[10]], [shard], [None])
    runtime.register_graph(1, [3], 3)
    # Offloaded: the values go to a host copy, the device storage is freed.
    host = shard.detach().cpu().clone()
    if ctx.device.type == "cuda":
        host = host.pin_memory()  # as offload allocates it: the staging copy is asynchronous
    shard.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"ds id 3: its device shard has no storage .* no host shard is set"):
        ops.allgather_param(shard, 1, 3)
    assert not runtime.is_gathered(3)
    with pytest.raises(RuntimeError, match="host shard of ds id 3 is Double"):
        runtime.set_host_shard(3, host.double())
    if ctx.device.type != "cpu":
        with pytest.raises(RuntimeError, match="must be a CPU tensor"):
            runtime.set_host_shard(3, host.to(ctx.device))
    runtime.set_host_shard(3, host)
    assert runtime.host_shard(3) is not None and runtime.host_shard(3).data_ptr() == host.data_ptr()
    out = ops.wait_allgather(ops.allgather_param(shard, 1, 3), 1, 3)
    assert torch.equal(out, full), (out, full)
    ops.release_param(out, 1, 3, 1)
    # Reloaded: the device shard is the source again.
    shard.untyped_storage().resize_(ppr * 4)
    shard.copy_(host.to(ctx.device) * 2)
    runtime.set_host_shard(3, None)
    assert runtime.host_shard(3) is None
    out = ops.wait_allgather(ops.allgather_param(shard, 1, 3), 1, 3)
    assert torch.equal(out, full * 2)
    ops.release_param(out, 1, 3, 1)


@pytest.mark.world_size(multiproc.single_world_size())
def test_runtime_gathers_from_the_host_shard_and_refuses_an_empty_shard_without_one():
    # 2 ranks on CPU; on GPUs as many as there are, up to 2 (one GPU: 1).
    run_distributed(_runtime_body, multiproc.single_world_size())


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("key", sorted(ON))
def test_parameter_offload_is_refused_under_zero12(stage, key):
    from deepcompile.config import Config, ConfigError

    cfg = _config(key)
    cfg["zero_optimization"]["stage"] = stage
    where = "zero_optimization.offload_param" if key == "offload_param" else "compile.offload_parameters"
    with pytest.raises(ConfigError, match=rf"{where}: parameter offload applies to ZeRO-3's partitioned "
                                          rf"parameters; under ZeRO-{stage}"):
        Config.from_any(cfg)


def test_nvme_parameter_offload_is_refused():
    from deepcompile.config import Config, ConfigError

    with pytest.raises(ConfigError, match="offload_param.device is 'nvme': NVMe parameter offload is not implemented"):
        Config.from_any({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    with pytest.raises(ConfigError, match=r"offload_param.device must be \"none\", \"cpu\" or \"nvme\""):
        Config.from_any({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})
    with pytest.raises(ConfigError, match="offload_param.buffer_count"):
        Config.from_any({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}})


def test_settings_follow_the_keys():
    from deepcompile.config import Config
    from deepcompile.offload import opt_state_offload_settings

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    s = opt_state_offload_settings(Config.from_any(_config("offload_param")), cpu)
    assert s.offload_masters and not s.offload_state and not s.pin_memory  # no pinning on a CPU device
    assert s.enabled_by == "zero_optimization.offload_param" and s.min_fraction == 0.0
    cfg = _config("offload_parameters", extra={"compile": {"memory_budget_bytes": 1 << 30}})
    s = opt_state_offload_settings(Config.from_any(cfg), cuda)  # a byte budget reads no device
    assert s.offload_masters and s.pin_memory and s.enabled_by == "compile.offload_parameters"
    unpinned = _config(None, extra={"zero_optimization": {"offload_param": {"device": "cpu"}},
                                    "compile": {"memory_budget_bytes": 1 << 30}})
    assert not opt_state_offload_settings(Config.from_any(unpinned), cuda).pin_memory  # pin_memory honoured
    both = _config("offload_param", extra={"compile": {"offload_opt_states": True}})
    s = opt_state_offload_settings(Config.from_any(both), cpu)
    assert s.offload_masters and s.offload_state
    assert opt_state_offload_settings(Config.from_any(_config(None)), cpu) is None
    off = _config(None, extra={"zero_optimization": {"offload_param": {"device": "none"}}})
    assert opt_state_offload_settings(Config.from_any(off), cpu) is None


def test_plan_forces_the_masters_out_and_counts_them():
    from deepcompile.offload.plan import plan_offload

    # Everything may stay, yet the forced tensor goes.
    plan = plan_offload([5, 3, 8], keep_limit=16, min_fraction=0.0, forced=[False, True, False])
    assert plan.offloaded == [False, True, False] and plan.offloaded_bytes == 3
    # 6 bytes over the limit: the forced 3 count, the smallest tensor covering the 3 missing goes.
    plan = plan_offload([5, 3, 8, 4], keep_limit=14, min_fraction=0.0, forced=[False, True, False, False])
    assert plan.offloaded == [False, True, False, True] and plan.resident_bytes == 13


def test_planned_masters_go_after_the_optimizer_state():
    from deepcompile.offload.plan import OffloadBudgetError, plan_offload

    # compile.offload_parameters: masters (priority 1) are candidates, but the optimizer state
    # (priority 0) goes first even where a master alone would cover what is missing.
    sizes, prio = [8, 4, 4, 8], [1, 0, 0, 1]
    plan = plan_offload(sizes, keep_limit=20, min_fraction=0.0, priority=prio)
    assert plan.offloaded == [False, True, False, False]  # 4 over: one state tensor
    plan = plan_offload(sizes, keep_limit=12, min_fraction=0.0, priority=prio)
    assert plan.offloaded == [True, True, True, False]  # 12 over: both states, then a master
    # Without a budget (CPU), every tensor of an enabled kind goes, and only those.
    plan = plan_offload(sizes, keep_limit=None, min_fraction=0.0, eligible=[True, False, False, True])
    assert plan.offloaded == [True, False, False, True]
    # A budget that only a disabled kind could meet is an error, not a silent offload of it.
    with pytest.raises(OffloadBudgetError, match="offload kind that is off"):
        plan_offload(sizes, keep_limit=10, min_fraction=0.0, eligible=[True, False, False, False])


# ---- GPU: parity and the device memory the masters no longer hold -------------------------------


def _gpu_body(ctx, steps: int, early: int):
    from deepcompile import runtime
    from deepcompile.offload.opt_states import MASTER

    mem = offload_gpu.device_memory(ctx)

    def at_early(engine):
        off = engine.offload
        assert off.copies.lanes.shares_runtime_lanes  # write-backs on the lane the gathers wait for
        masters = [u for u in off.units.values() if u.what == MASTER]
        assert masters and all(u.on_host for u in masters)
        assert not any(u.on_host for u in off.units.values() if u.what != MASTER)  # Adam state stays
        assert all(runtime.registered_shard(i).untyped_storage().nbytes() == 0 for u in masters for i in u.ds_ids)
        # Views of the units' own (exact-size, page-locked) host buffers.
        assert all(runtime.host_shard(i).untyped_storage().data_ptr() == u.host.untyped_storage().data_ptr()
                   for u in masters for i in u.ds_ids)
        return masters

    base = offload_gpu.train_and_read(ctx, mem, {"stage": 3}, steps, early)
    offload = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    got = offload_gpu.train_and_read(ctx, mem, offload, steps, early, at_early=at_early)
    # Parity, no growth from step `early` to the last (the masters leave the device after every
    # step), and between steps at least the masters' bytes less device memory than without offload.
    offload_gpu.assert_parity_and_memory(base, got, steps, early)


@pytest.mark.world_size(multiproc.single_world_size())
@pytest.mark.gpu
def test_param_offload_gpu_parity_and_memory():
    run_distributed(_gpu_body, multiproc.single_world_size(), args=(50, 5), timeout=600)


# ---- from the first forward ------------------------------------------------------------------


def _from_start_body(ctx, key):
    """The masters are on the host before the first forward (a model that only fits with them
    there runs from its first step), and that first step trains exactly as without offload."""
    import deepcompile
    from deepcompile import runtime

    base, engine = _train(ctx, "mlp", _config(None), "eager", 2)
    engine.destroy()
    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _config(key))
    trainable = [sp for sp in engine.sharding.params if sp.trainable]
    assert trainable
    for sp in trainable:
        assert sp.shard.untyped_storage().nbytes() == 0, sp.name
        assert runtime.host_shard(sp.ds_id) is not None, sp.name
    engine.compile(backend="eager")
    got = run_steps(engine, "mlp", 2, ctx.device)
    engine.destroy()
    assert got.losses == base.losses
    for name, value in base.params.items():
        assert torch.equal(got.params[name], value), name


@cpu_only
@pytest.mark.parametrize("key", sorted(ON))
def test_masters_are_on_the_host_from_the_first_forward(key):
    run_distributed(_from_start_body, 2, args=(key,))
