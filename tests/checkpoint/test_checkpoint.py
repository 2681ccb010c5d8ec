"""engine.save_checkpoint / engine.load_checkpoint: real DCP directories (tmp_path), real gloo
ranks (one per GPU under DC_TEST_DEVICE=cuda, where the world sizes below fit).

* A resumed run continues exactly: saving at step k and resuming for m steps in a fresh engine
  (fresh model, other initial values, perturbed random generators) gives bitwise the losses and
  parameters of one uninterrupted k+m-step run, on ZeRO-1, 2 and 3, with gradient accumulation,
  dropout (the random generators), an LR schedule, and, on ZeRO-3, compiled graphs with the
  profile-guided schedule switched before the save (the resumed run re-profiles); also a tiny
  transformers Llama.
* A checkpoint loads at another world size (ZeRO-3, 2 -> 3 ranks) and another stage (ZeRO-3 ->
  ZeRO-1): right after loading, the parameters and optimizer state equal the saved ones exactly,
  and training goes on like single-process training of the same k+m steps.
* Bad input is refused on every rank with an error naming the problem, before anything of the
  engine changes: another model (names, shapes), another optimizer or scheduler, a missing, empty
  or cut-off directory; a save in the middle of an accumulation window; a save that fails on one
  rank commits nothing and leaves the checkpoint already there, and ``latest``, as they were.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _harness import multiproc
from _harness.multiproc import require_world_size, run_distributed
from _harness.parity_cases import GLOBAL_BATCH, MLP, batch, build_model, make_optimizer

pytestmark = pytest.mark.world_size(2)  # the world size in every test id (conftest.py)

# Across world sizes and stages the gradients are summed in another order (other slices per rank,
# other reduction trees), so fp32 results agree to rounding, not bitwise. The parity suites' fp32
# tolerance (tests/parity/test_zero3_parity.py) bounds that over a handful of steps: Adam's eps=1e-3
# (make_optimizer) keeps it from amplifying last-bit differences, while a wrong gradient or a lost
# optimizer state (Adam restarting its moments) moves the parameters by ~lr = 1e-2.
CROSS_TOL = dict(rtol=1e-5, atol=1e-6)
TIMEOUT = 300
# A resumed run is bitwise the uninterrupted one on CPU. CUDA kernels that add with atomics
# (embedding backward, index_add) sum in a varying order, so two identical GPU runs already differ
# in the last bits: there the continuation is compared at the fp32 tolerance above. Loading itself
# is a copy and is compared exactly everywhere.
RESUME_EXACT = multiproc.test_device_type() == "cpu"


class DropoutMLP(MLP):
    """Dropout between the layers: the losses depend on every rank's random generator."""

    def forward(self, x, y):
        h = nn.functional.dropout(nn.functional.gelu(self.fc1(x)), p=0.3, training=True)
        return ((self.fc2(h) - y) ** 2).mean()


class WiderMLP(MLP):
    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(13, 6)


class RenamedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)


class BufferedMLP(MLP):
    """A persistent buffer, changed by every forward: checkpoints carry buffers too."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, x, y):
        self.calls += 1
        return super().forward(x, y)


LOCAL_MODELS = {"dropout": DropoutMLP, "wider": WiderMLP, "renamed": RenamedMLP, "buffered": BufferedMLP}


def _model(name, seed=1234, device="cpu"):
    if name not in LOCAL_MODELS:
        model = build_model(name, device=device)
        if seed != 1234:  # other initial values: what a resumed run must overwrite
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
        return model
    torch.manual_seed(seed)
    return LOCAL_MODELS[name]().to(device)


def _data_name(name):
    return "mlp" if name in LOCAL_MODELS else name


def _engine(ctx, name, stage, seed=1234, gas=1, scheduler="warmup", backend=None, compile_cfg=None, optimizer=None):
    import deepcompile

    torch._dynamo.reset()
    model = _model(name, seed, ctx.device)
    cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 10},
           "gradient_accumulation_steps": gas}
    kwargs = {}
    if scheduler == "warmup":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_min_lr": 0.0}}
    elif scheduler == "step":
        kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if compile_cfg is not None:
        cfg["compile"] = compile_cfg
    opt = (optimizer or make_optimizer)(model.parameters())
    engine = deepcompile.initialize(model, opt, cfg, **kwargs)
    if backend is not None:
        engine.compile(backend=backend)
    return engine


def _train(engine, ctx, name, steps, gas=1):
    """``steps`` optimizer steps from the engine's current step; the mean loss of every micro-step."""
    n = GLOBAL_BATCH // ctx.world_size
    losses = []
    for _ in range(steps):
        for _ in range(gas):
            x, y = batch(_data_name(name), engine.micro_steps, device=ctx.device)
            loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
            engine.backward(loss)
            engine.step()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / ctx.world_size)
    return losses


def _all_ranks(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _full_optimizer_state(engine):
    """Every parameter's optimizer state, assembled from all ranks: {name: {key: full flat tensor}}."""
    pieces = []
    for s in engine.sharding.shards():
        for key, value in engine.sharding.shard_optimizer_state(s.ds_id).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                pieces.append((s.name, key, s.numel, s.start, value.detach().cpu().clone()))
            else:
                pieces.append((s.name, key, None, None, torch.as_tensor(value).cpu().clone()))
    full = {}
    for rank_pieces in _all_ranks(pieces):
        for name, key, numel, start, value in rank_pieces:
            if numel is None:
                full.setdefault(name, {})[key] = value
                continue
            flat = full.setdefault(name, {}).setdefault(key, torch.full((numel,), float("nan")))
            flat[start:start + value.numel()] = value
    return full


def _assert_bitwise(got, want, what, exact=True):
    assert got.keys() == want.keys(), f"{what}: {sorted(got)} != {sorted(want)}"
    for k in want:
        if isinstance(want[k], dict):
            _assert_bitwise(got[k], want[k], f"{what}[{k}]", exact)
        elif exact:
            assert torch.equal(got[k], want[k]), f"{what}[{k}] differs: max |diff| {(got[k] - want[k]).abs().max()}"
        else:
            torch.testing.assert_close(got[k], want[k], **CROSS_TOL, msg=lambda m: f"{what}[{k}]: {m}")


def _state(engine):
    return {k: v.clone() for k, v in engine.full_state_dict(all_ranks=True).items()}


# ---- exact resume ---------------------------------------------------------------------------------


def _resume_body(ctx, root, name, stage, gas, k, m, backend, compile_cfg):
    from deepcompile.checkpoint.agreement import CheckpointError

    kw = dict(gas=gas, backend=backend, compile_cfg=compile_cfg)
    # Uninterrupted k + m steps; each rank's dropout stream seeded differently.
    engine = _engine(ctx, name, stage, **kw)
    torch.manual_seed(50 + ctx.rank)
    straight = _train(engine, ctx, name, k + m, gas)
    straight_state, straight_opt = _state(engine), _full_optimizer_state(engine)
    engine.destroy()

    # k steps, with a refused save in the middle of an accumulation window on the way.
    engine = _engine(ctx, name, stage, **kw)
    torch.manual_seed(50 + ctx.rank)
    first = _train(engine, ctx, name, k - 1, gas)
    if gas > 1:
        n = GLOBAL_BATCH // ctx.world_size
        x, y = batch(_data_name(name), engine.micro_steps, device=ctx.device)
        loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
        engine.backward(loss)
        engine.step()
        with pytest.raises(CheckpointError, match=r"middle of a gradient accumulation window \(micro-step 1 of"):
            engine.save_checkpoint(root)
        assert not os.path.isdir(root) or not os.listdir(root), "a refused save left files behind"
        total = loss.detach().clone()
        dist.all_reduce(total)
        first.append(total.item() / ctx.world_size)
        for _ in range(gas - 1):  # the rest of the window
            x, y = batch(_data_name(name), engine.micro_steps, device=ctx.device)
            loss = engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n])
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            first.append(total.item() / ctx.world_size)
    else:
        first += _train(engine, ctx, name, 1, gas)
    saved_lr = engine.get_lr()
    path = engine.save_checkpoint(root, client_state={"epoch": 7})
    engine.destroy()
    assert path == os.path.join(root, f"global_step{k}")
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == f"global_step{k}"

    # A fresh engine (other initial values, other random state) resumes for m steps.
    engine = _engine(ctx, name, stage, seed=999, **kw)
    torch.manual_seed(12345)
    loaded_path, client = engine.load_checkpoint(root)
    assert loaded_path == path and client == {"epoch": 7}
    assert engine.global_steps == k and engine.micro_steps == k * gas
    assert engine.get_lr() == saved_lr
    rest = _train(engine, ctx, name, m, gas)
    if RESUME_EXACT:
        assert first + rest == straight, f"losses differ:\n{first + rest}\n{straight}"
    else:
        torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(straight), **CROSS_TOL)
    _assert_bitwise(_state(engine), straight_state, "parameters", RESUME_EXACT)
    _assert_bitwise(_full_optimizer_state(engine), straight_opt, "optimizer state", RESUME_EXACT)
    if compile_cfg is not None:
        # The resumed run re-profiled at its first step and switched plans after it.
        assert engine.schedule_report(), "the resumed run did not re-plan the profile-guided schedule"
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_is_bitwise_zero12(stage, tmp_path):
    run_distributed(_resume_body, 2, args=(str(tmp_path / "ckpt"), "dropout", stage, 2, 3, 2, None, None),
                    timeout=TIMEOUT)


def test_resume_is_bitwise_zero3_compiled_after_the_schedule_switch(tmp_path):
    # warmup_steps 2: steps 0-1 plain (1 profiled), the passes from step 2; the save is at step 3.
    compile_cfg = {"warmup_steps": 2, "memory_budget_bytes": 1 << 30}
    run_distributed(_resume_body, 2, args=(str(tmp_path / "ckpt"), "dropout", 3, 2, 3, 2, "eager", compile_cfg),
                    timeout=TIMEOUT)


def test_resume_is_bitwise_llama_zero3(tmp_path):
    run_distributed(_resume_body, 2, args=(str(tmp_path / "ckpt"), "llama", 3, 1, 2, 2, None, None), timeout=TIMEOUT)


def test_resume_restores_buffers_zero1(tmp_path):
    run_distributed(_resume_body, 2, args=(str(tmp_path / "ckpt"), "buffered", 1, 1, 2, 1, None, None),
                    timeout=TIMEOUT)


# ---- another world size, another stage ------------------------------------------------------------


def _reference(name, steps, device):
    """Single process, whole batches, AdamW + StepLR: losses and parameters."""
    model = _model(name, device=device)
    opt = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for step in range(steps):
        loss = model(*batch(_data_name(name), step, device=device))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        sched.step()
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _save_body(ctx, root, name, stage, k):
    engine = _engine(ctx, name, stage, scheduler="step")
    losses = _train(engine, ctx, name, k)
    engine.save_checkpoint(root, tag="resumable")
    expected = {"losses": losses, "state": _state(engine), "opt": _full_optimizer_state(engine), "lr": engine.get_lr()}
    if ctx.rank == 0:
        torch.save(expected, os.path.join(root, "expected.pt"))
    engine.destroy()


def assert_resumed(engine, ctx, name, expected, k, m, what=""):
    """``engine`` just loaded the checkpoint whose state after ``k`` steps is ``expected`` (the
    saving run's losses, parameters, optimizer state, learning rate): it holds exactly the saved
    values, whatever the new partitioning, and ``m`` more steps continue single-process training."""
    _assert_bitwise(_state(engine), expected["state"], f"{what}parameters after loading")
    _assert_bitwise(_full_optimizer_state(engine), expected["opt"], f"{what}optimizer state after loading")
    assert engine.get_lr() == expected["lr"] and engine.global_steps == k
    losses = expected["losses"] + _train(engine, ctx, name, m)
    ref_losses, ref_state = _reference(name, k + m, ctx.device)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **CROSS_TOL)
    state = engine.full_state_dict(all_ranks=True)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key].float(), value.float(), **CROSS_TOL, msg=lambda msg: f"{key}: {msg}")


def _load_body(ctx, root, name, stage, k, m):
    engine = _engine(ctx, name, stage, seed=999, scheduler="step")
    engine.load_checkpoint(root)
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=False)
    assert_resumed(engine, ctx, name, expected, k, m)
    engine.destroy()


@pytest.mark.world_size(2, 3)
def test_load_at_another_world_size_zero3_2_to_3(tmp_path):
    require_world_size(3)
    root = str(tmp_path / "ckpt")
    run_distributed(_save_body, 2, args=(root, "tied", 3, 3), timeout=TIMEOUT)
    run_distributed(_load_body, 3, args=(root, "tied", 3, 3, 2), timeout=TIMEOUT)


def test_load_at_another_stage_zero3_to_zero1(tmp_path):
    # LoRA: frozen base weights are partitioned at ZeRO-3 and whole at ZeRO-1.
    root = str(tmp_path / "ckpt")
    run_distributed(_save_body, 2, args=(root, "lora", 3, 3), timeout=TIMEOUT)
    run_distributed(_load_body, 2, args=(root, "lora", 1, 3, 2), timeout=TIMEOUT)


# ---- refused input --------------------------------------------------------------------------------


def _mismatch_body(ctx, root):
    from deepcompile.checkpoint.agreement import CheckpointError

    engine = _engine(ctx, "mlp", 3)
    _train(engine, ctx, "mlp", 1)
    engine.save_checkpoint(root)
    saved = _state(engine)
    engine.destroy()

    def refused(name, match, **load_kw):
        extra = {k: load_kw.pop(k) for k in ("scheduler", "optimizer") if k in load_kw}
        engine = _engine(ctx, name, 3, seed=999, **extra)
        before = _state(engine)
        with pytest.raises(CheckpointError, match=match) as info:
            engine.load_checkpoint(root, **load_kw)
        _assert_bitwise(_state(engine), before, "parameters after a refused load")
        assert engine.global_steps == 0
        engine.destroy()
        return str(info.value)

    msg = refused("wider", r"does not match the model: parameters of another shape: ")
    assert "fc2.weight (checkpoint [5, 13], model [6, 13])" in msg and "fc2.bias (checkpoint [5], model [6])" in msg, msg
    assert "on every rank" in msg
    msg = refused("renamed", "does not match the model")
    assert "parameters of the model missing from the checkpoint: inp.bias, inp.weight" in msg, msg
    assert "parameters in the checkpoint that the model does not have: fc1.bias, fc1.weight" in msg, msg
    refused("mlp", r"holds the state of a AdamW optimizer, the engine's is a SGD; pass load_optimizer_states=False",
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    refused("mlp", r"holds the state of a WarmupSchedule LR scheduler, but the engine has none", scheduler=None)

    # What the errors point to works: weights only into an SGD engine.
    engine = _engine(ctx, "mlp", 3, seed=999, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    engine.load_checkpoint(root, load_optimizer_states=False)
    _assert_bitwise(_state(engine), saved, "weights loaded without optimizer state")
    assert engine.global_steps == 1 and not engine.basic_optimizer.state
    engine.destroy()
    # ... and the module alone into an engine with neither that optimizer nor a schedule.
    engine = _engine(ctx, "mlp", 3, seed=999, scheduler=None, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    engine.load_checkpoint(root, load_module_only=True)
    _assert_bitwise(_state(engine), saved, "weights loaded with load_module_only")
    assert engine.global_steps == 0
    engine.destroy()


def test_checkpoint_of_another_model_or_optimizer_is_refused_naming_what_differs(tmp_path):
    run_distributed(_mismatch_body, 2, args=(str(tmp_path / "ckpt"),), timeout=TIMEOUT)


def _bad_dirs_body(ctx, root):
    from deepcompile.checkpoint.agreement import CheckpointError

    engine = _engine(ctx, "mlp", 2)

    def refused(where, match, tag=None):
        with pytest.raises(CheckpointError, match=match) as info:
            engine.load_checkpoint(where, tag=tag)
        assert "on every rank" in str(info.value)

    refused(os.path.join(root, "nowhere"), r"checkpoint directory '.*nowhere' does not exist")
    empty = os.path.join(root, "empty")
    if ctx.rank == 0:
        os.makedirs(empty)
        with open(os.path.join(root, "a_file"), "w") as f:
            f.write("x")
    dist.barrier()
    refused(os.path.join(root, "a_file"), "is not a directory")
    refused(empty, "is empty: there is no checkpoint to load")

    # A save cut off before its commit: a complete-looking write under the temporary name.
    good = os.path.join(root, "good")
    engine.save_checkpoint(good, tag="step1")
    cut = os.path.join(root, "cut")
    if ctx.rank == 0:
        os.makedirs(cut)
        shutil.copytree(os.path.join(good, "step1"), os.path.join(cut, "step2.tmp-0123abcd"))
    dist.barrier()
    refused(cut, r"holds only saves that were cut off before they were committed \(step2.tmp-0123abcd\)")
    refused(cut, r"checkpoint 'step2' in .* was never committed: its save was cut off", tag="step2")
    # ... next to a committed checkpoint: loading takes the committed one, never the partial write.
    if ctx.rank == 0:
        shutil.copytree(os.path.join(good, "step1", ), os.path.join(good, "step2.tmp-0123abcd"))
    dist.barrier()
    assert engine.load_checkpoint(good)[0] == os.path.join(good, "step1")
    refused(good, r"checkpoint 'step2' in .* was never committed", tag="step2")
    refused(good, r"there is no checkpoint 'step9' in .*; complete checkpoints there: \['step1'\]", tag="step9")
    # A directory without the files a finished save writes, and one without 'latest'.
    if ctx.rank == 0:
        os.remove(os.path.join(good, "step2.tmp-0123abcd", ".metadata"))
        os.rename(os.path.join(good, "step2.tmp-0123abcd"), os.path.join(good, "step2"))
        os.remove(os.path.join(good, "latest"))
    dist.barrier()
    refused(good, r"'.*step2' is not a complete deepcompile checkpoint: it lacks .metadata", tag="step2")
    refused(good, r"has no 'latest' file naming the checkpoint to load; pass tag= one of \['step1', 'step2'\]")
    refused(good, r"cannot be a path", tag="../good")
    engine.destroy()


def test_missing_empty_and_cut_off_checkpoints_are_refused_on_every_rank(tmp_path):
    run_distributed(_bad_dirs_body, 2, args=(str(tmp_path),), timeout=TIMEOUT)


def _failed_save_body(ctx, root):
    import torch.distributed.checkpoint as dcp

    from deepcompile.checkpoint.agreement import CheckpointError

    engine = _engine(ctx, "mlp", 2)
    _train(engine, ctx, "mlp", 1)
    engine.save_checkpoint(root, tag="a")
    committed = _state(engine)
    _train(engine, ctx, "mlp", 1)

    def failing_on_rank_1(what):
        original = dcp.FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if ctx.rank == 1:
                raise OSError(f"No space left on device (injected while writing {what})")
            return original(self, plan, planner)

        return original, write_data

    for tag in ("b", "a"):  # a new tag, and overwriting the committed one
        original, broken = failing_on_rank_1(tag)
        dcp.FileSystemWriter.write_data = broken
        try:
            with pytest.raises(CheckpointError, match=rf"writing '{tag}' \(nothing was committed.*rank 1 .*No space left on device"):
                engine.save_checkpoint(root, tag=tag)
        finally:
            dcp.FileSystemWriter.write_data = original
        dist.barrier()
        assert sorted(os.listdir(root)) == ["a", "latest"], os.listdir(root)
        with open(os.path.join(root, "latest")) as f:
            assert f.read() == "a"

    # A rank failing before anything is written (its optimizer state cannot be read).
    original = engine.sharding.shard_optimizer_state
    if ctx.rank == 0:
        engine.sharding.shard_optimizer_state = lambda ds_id: {"exp_avg": torch.zeros(3, 3)}
    with pytest.raises(CheckpointError, match=r"(?s)optimizer state 'exp_avg' of fc1.weight has shape \(3, 3\).*rank 0"):
        engine.save_checkpoint(root, tag="c")
    engine.sharding.shard_optimizer_state = original
    assert sorted(os.listdir(root)) == ["a", "latest"]

    # The committed checkpoint is intact...
    fresh = _engine(ctx, "mlp", 2, seed=999)
    fresh.load_checkpoint(root)
    _assert_bitwise(_state(fresh), committed, "checkpoint 'a' after failed saves")
    fresh.destroy()
    # ... and a successful save of the same tag replaces it, leaving nothing aside.
    engine.save_checkpoint(root, tag="a")
    now = _state(engine)
    assert sorted(os.listdir(root)) == ["a", "latest"]
    fresh = _engine(ctx, "mlp", 2, seed=999)
    fresh.load_checkpoint(root, tag="a")
    _assert_bitwise(_state(fresh), now, "checkpoint 'a' after it was saved again")
    fresh.destroy()
    with open(os.path.join(root, "a", "deepcompile.json")) as f:
        meta = json.load(f)
    assert meta["global_steps"] == 2 and meta["zero_stage"] == 2 and meta["world_size"] == ctx.world_size
    engine.destroy()


def test_a_failed_save_commits_nothing_and_keeps_the_checkpoint_there(tmp_path):
    run_distributed(_failed_save_body, 2, args=(str(tmp_path / "ckpt"),), timeout=TIMEOUT)
