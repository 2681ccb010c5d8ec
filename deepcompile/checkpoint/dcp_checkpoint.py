"""``engine.save_checkpoint`` / ``engine.load_checkpoint``: training state through
``torch.distributed.checkpoint`` (DCP), every rank writing and reading only its own shards.

What one checkpoint holds (DCP keys; ``docs/design/checkpoints.md``, "Format"):

* ``model/<name>``: every parameter as one logical 1-D tensor of ``numel`` elements (the
  parameter flattened in row-major order), written as each rank's ``[start, end)`` chunk
  (``Sharding.shards()``): the fp32 master weights of trainable parameters, the parameter's own
  dtype for the others. Parameters a stage does not partition (ZeRO-1/2 frozen ones) are written
  whole by rank 0, in the same form, so any stage reads any stage's checkpoint;
* ``optim/<name>/<key>``: per-element optimizer state (Adam's moments ...) in the same form;
  ``optim_scalars``: scalar state per parameter (Adam's ``step``); ``optim_param_groups``: the
  param groups' hyper-parameters;
* ``buffers/<name>``: the module's persistent buffers (rank 0), ``lr_scheduler``: its state dict,
  ``engine``: the step counters and fp16's loss scale, ``client_state``: what the caller passed,
  ``rng/<rank>``: each rank's random number generators;
* ``deepcompile.json`` (a file beside DCP's): format version, world size, stage, parameter names
  and shapes, optimizer and scheduler types, the config (for reference: it is not applied).

Every step that can fail on one rank runs under ``agreement.agreed``, so a failure is raised on
every rank together; the directory protocol (temporary name, commit by rename, ``latest`` last)
is ``layout.py``'s.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import uuid
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from deepcompile.checkpoint import layout, rng_state
from deepcompile.checkpoint.agreement import CheckpointError, agreed
from deepcompile.checkpoint.flat_planners import FlatRange, FlatRangeLoadPlanner, FlatRangeSavePlanner
from deepcompile.checkpoint.training_state import StepCounters, TrainingState
from deepcompile.faults.injection import kill_point
from deepcompile.zero.param_shard import ParamShard

MODEL = "model/"
OPTIM = "optim/"
BUFFERS = "buffers/"
RNG = "rng/"
SCALARS = "optim_scalars"
PARAM_GROUPS = "optim_param_groups"
LR_SCHEDULER = "lr_scheduler"
ENGINE = "engine"
CLIENT_STATE = "client_state"


# ---- what the training state holds, by name ------------------------------------------------------


@dataclasses.dataclass
class _ModelView:
    shards: List[ParamShard]  # partitioned parameters, this rank's piece of each
    whole: Dict[str, nn.Parameter]  # parameters the stage keeps whole on every rank
    buffers: Dict[str, torch.Tensor]  # persistent buffers

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        out = {s.name: tuple(s.shape) for s in self.shards}
        out.update({n: tuple(p.shape) for n, p in self.whole.items()})
        return out


def _model_view(state: TrainingState) -> _ModelView:
    shards = list(state.sharding.shards())
    partitioned = {s.name for s in shards}
    whole = {n: p for n, p in state.module.named_parameters() if n not in partitioned}
    param_ids = {id(p) for p in state.module.parameters()}
    buffers, extra = {}, []
    for name, value in state.module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            extra.append(name)
        elif id(value) not in param_ids:
            buffers[name] = value
    if extra:
        raise CheckpointError(f"module extra state (get_extra_state) cannot be saved in a deepcompile checkpoint: {extra}")
    return _ModelView(shards, whole, buffers)


def _split_optimizer_state(name: str, state: Dict[str, Any], length: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Per-element state (1-D, lined up with the shard's ``length`` elements) and scalar state."""
    per_element, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.dim() != 1 or value.numel() != length:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}: neither per-element (lined up "
                    f"with this rank's {length} elements) nor a scalar, which is all a checkpoint can store")
            per_element[key] = value
        else:
            scalars[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return per_element, scalars


def _all_gather(obj: Any, group) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# ---- save ----------------------------------------------------------------------------------------


def _collect(state: TrainingState, client_state: Dict[str, Any]):
    """This rank's flat ranges and objects to write, and (rank 0) the description file."""
    rank0 = state.rank == 0
    view = _model_view(state)
    ranges: List[FlatRange] = []
    params: Dict[str, Dict[str, Any]] = {}
    state_keys: Dict[str, List[str]] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    # Under hybrid sharding only the first shard group writes the partitioned pieces: a replica's
    # piece is the same chunk again, which DCP would count as an overlap.
    shard_ranges: List[FlatRange] = []
    for s in view.shards:
        # A parameter without elements still gets one (empty) chunk, from rank 0, to be listed.
        shard_ranges.append(FlatRange(MODEL + s.name, s.numel, s.start, s.local.detach(),
                                      write_if_empty=rank0 and s.numel == 0))
        params[s.name] = {"shape": list(s.shape), "dtype": _dtype_name(s.local)}
        per_element, scalar = _split_optimizer_state(s.name, state.sharding.shard_optimizer_state(s.ds_id),
                                                     s.end - s.start)
        for key, value in per_element.items():
            shard_ranges.append(FlatRange(f"{OPTIM}{s.name}/{key}", s.numel, s.start, value.detach(),
                                          write_if_empty=rank0 and s.numel == 0))
        if per_element or scalar:
            state_keys[s.name] = sorted(per_element)
            scalars[s.name] = scalar
    if state.writes_shards:
        ranges.extend(shard_ranges)
    for name, p in view.whole.items():
        flat = p.detach().reshape(-1)
        ranges.append(FlatRange(MODEL + name, flat.numel(), 0, flat if rank0 else flat[:0], write_if_empty=rank0))
        params[name] = {"shape": list(p.shape), "dtype": _dtype_name(p)}

    objects: Dict[str, Any] = {f"{RNG}{state.rank}": rng_state.capture(state.device)}
    meta: Dict[str, Any] = {}
    if rank0:
        optimizer = state.optimizer
        objects.update({BUFFERS + n: b.detach() for n, b in view.buffers.items()})
        objects[SCALARS] = scalars
        objects[PARAM_GROUPS] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        objects[ENGINE] = {"global_steps": state.counters.global_steps, "micro_steps": state.counters.micro_steps,
                           "gradient_accumulation_steps": state.gradient_accumulation_steps,
                           # fp16: the loss scale and its counters ({} without loss scaling).
                           "skipped_steps": state.counters.skipped_steps, "loss_scaler": state.loss_scaler.state_dict()}
        objects[CLIENT_STATE] = client_state
        if state.lr_scheduler is not None:
            objects[LR_SCHEDULER] = state.lr_scheduler.state_dict()
        meta = {
            "format": layout.FORMAT, "version": layout.VERSION, "torch_version": torch.__version__,
            "world_size": state.world_size, "zero_stage": state.stage,
            "global_steps": state.counters.global_steps, "micro_steps": state.counters.micro_steps,
            "params": params, "buffers": {n: list(b.shape) for n, b in view.buffers.items()},
            "optimizer": {"class": type(optimizer).__qualname__, "param_groups": len(optimizer.param_groups),
                          "state": state_keys},
            "lr_scheduler": None if state.lr_scheduler is None else type(state.lr_scheduler).__qualname__,
            "config": state.config,
        }
    return ranges, objects, meta


def _writer(path: str) -> "dcp.FileSystemWriter":
    """DCP's file writer, set for throughput and bounded host memory.

    One file per stored item, not one per rank: DCP's writer keeps the host copy of every tensor
    of a file until the file is closed, so one file per rank held a host copy of the rank's whole
    shard during a save from the GPU (34 GiB of host memory for a 7B model, bench/results/2026-11-24.md).
    Several writer threads, each copying and writing its own files, overlap device-to-host copies
    with disk writes; the ranks of one host share its cores."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(1, min(8, (os.cpu_count() or 1) // local_ranks))
    return dcp.FileSystemWriter(path, single_file_per_rank=False, thread_count=threads)


def save_checkpoint(state: TrainingState, save_dir: Any, tag: Any = None, client_state: Optional[Dict[str, Any]] = None,
                    save_latest: bool = True) -> str:
    """See :meth:`deepcompile.engine.Engine.save_checkpoint`. Collective."""
    group, rank = state.group, state.rank
    save_dir = os.path.abspath(os.fspath(save_dir))
    tag = f"global_step{state.counters.global_steps}" if tag is None else str(tag)
    tags = _all_gather(tag, group)

    def check_and_collect():
        if len(set(tags)) > 1:
            raise CheckpointError(f"the ranks passed different tags: {tags}")
        layout.check_tag(tag)
        position = state.counters.micro_steps % state.gradient_accumulation_steps
        if position:
            raise CheckpointError(
                f"cannot save in the middle of a gradient accumulation window (micro-step {position} of "
                f"{state.gradient_accumulation_steps}): the gradients accumulated so far are not part of a "
                "checkpoint; save after the engine.step() that ends the window")
        return _collect(state, dict(client_state or {}))

    ranges, objects, meta = agreed("save_checkpoint", check_and_collect, group)
    nonce = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    tmp, final = layout.temporary_path(save_dir, tag, nonce[0]), os.path.join(save_dir, tag)

    def make_tmp():
        if rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            os.mkdir(tmp)

    def see_tmp():
        if not os.path.isdir(tmp):
            raise CheckpointError(f"{tmp!r}, made by rank 0, is not visible here: a checkpoint directory must be on a "
                                  "filesystem that every rank shares")

    agreed("save_checkpoint", make_tmp, group)
    committed = False
    try:
        agreed("save_checkpoint", see_tmp, group)
        kill_point("save:before_write", rank)  # tests: what survives a rank killed at each point

        def write():
            dcp.save(objects, storage_writer=_writer(tmp), planner=FlatRangeSavePlanner(ranges),
                     process_group=group)
            kill_point("save:after_write", rank)
            if rank == 0:
                layout.write_json(os.path.join(tmp, layout.META_FILE), meta)

        agreed(f"save_checkpoint: writing {tag!r} (nothing was committed; what was in {save_dir!r} is unchanged)",
               write, group)
        kill_point("save:before_commit", rank)
        agreed(f"save_checkpoint: committing {tag!r}", lambda: rank == 0 and layout.commit(tmp, final), group)
        committed = True
    finally:
        if not committed and rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    if save_latest:
        kill_point("save:before_latest", rank)
        agreed(f"save_checkpoint: {tag!r} was saved, but updating {layout.LATEST!r} failed",
               lambda: rank == 0 and layout.write_latest(save_dir, tag, nonce[0]), group)
    return final


# ---- load ----------------------------------------------------------------------------------------


def _names(items: List[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")


def _check_model(path: str, meta: Dict[str, Any], stored: Dict[str, Any], view: _ModelView) -> None:
    problems = []
    for kind, expected, saved in (
        ("parameters", view.shapes(), {n: tuple(d["shape"]) for n, d in meta["params"].items()}),
        ("buffers", {n: tuple(b.shape) for n, b in view.buffers.items()}, {n: tuple(s) for n, s in meta["buffers"].items()}),
    ):
        missing = sorted(set(expected) - set(saved))
        extra = sorted(set(saved) - set(expected))
        wrong = [f"{n} (checkpoint {list(saved[n])}, model {list(expected[n])})"
                 for n in sorted(set(saved) & set(expected)) if saved[n] != expected[n]]
        if missing:
            problems.append(f"{kind} of the model missing from the checkpoint: {_names(missing)}")
        if extra:
            problems.append(f"{kind} in the checkpoint that the model does not have: {_names(extra)}")
        if wrong:
            problems.append(f"{kind} of another shape: {_names(wrong)}")
    if problems:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: " + "; ".join(problems))
    damaged = [MODEL + n for n, shape in view.shapes().items()
               if not _stored_as(stored, MODEL + n, [int(torch.Size(shape).numel())])]
    damaged += [BUFFERS + n for n, b in view.buffers.items() if not _stored_as(stored, BUFFERS + n, list(b.shape))]
    if damaged:
        raise CheckpointError(f"checkpoint {path!r} is damaged: its DCP metadata lacks or mis-sizes {_names(damaged)}")


def _stored_as(stored: Dict[str, Any], key: str, size: List[int]) -> bool:
    md = stored.get(key)
    return isinstance(md, TensorStorageMetadata) and list(md.size) == size


def _check_optimizer(path: str, meta: Dict[str, Any], stored: Dict[str, Any], state: TrainingState, view: _ModelView) -> None:
    saved, optimizer = meta["optimizer"], state.optimizer
    if saved["class"] != type(optimizer).__qualname__:
        raise CheckpointError(f"checkpoint {path!r} holds the state of a {saved['class']} optimizer, the engine's is a "
                              f"{type(optimizer).__qualname__}; pass load_optimizer_states=False to load the weights only")
    if saved["param_groups"] != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path!r} has {saved['param_groups']} optimizer param groups, the engine's "
                              f"optimizer {len(optimizer.param_groups)}; pass load_optimizer_states=False to load the "
                              "weights only")
    numel = {n: int(torch.Size(s).numel()) for n, s in view.shapes().items()}
    damaged = [f"{OPTIM}{n}/{k}" for n, keys in saved["state"].items() for k in keys
               if not _stored_as(stored, f"{OPTIM}{n}/{k}", [numel[n]])]
    if PARAM_GROUPS not in stored or SCALARS not in stored:
        damaged.append(PARAM_GROUPS if PARAM_GROUPS not in stored else SCALARS)
    if damaged:
        raise CheckpointError(f"checkpoint {path!r} is damaged: its DCP metadata lacks or mis-sizes {_names(damaged)}")


def _check_scheduler(path: str, meta: Dict[str, Any], stored: Dict[str, Any], state: TrainingState) -> None:
    saved, current = meta["lr_scheduler"], state.lr_scheduler
    if current is not None and saved is None:
        raise CheckpointError(f"checkpoint {path!r} has no LR scheduler state, but the engine has a "
                              f"{type(current).__qualname__}; pass load_lr_scheduler_states=False to keep it as it is")
    if current is None and saved is not None:
        raise CheckpointError(f"checkpoint {path!r} holds the state of a {saved} LR scheduler, but the engine has none; "
                              "pass load_lr_scheduler_states=False to leave it out")
    if saved is not None and saved != type(current).__qualname__:
        raise CheckpointError(f"checkpoint {path!r} holds the state of a {saved} LR scheduler, the engine's is a "
                              f"{type(current).__qualname__}; pass load_lr_scheduler_states=False to leave it out")
    if saved is not None and LR_SCHEDULER not in stored:
        raise CheckpointError(f"checkpoint {path!r} is damaged: its DCP metadata lacks {LR_SCHEDULER}")


def _reader(path: str):
    return dcp.FileSystemReader(path)


def load_checkpoint(state: TrainingState, load_dir: Any, tag: Any = None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False
                    ) -> Tuple[str, Dict[str, Any], Optional[StepCounters]]:
    """See :meth:`deepcompile.engine.Engine.load_checkpoint`. Collective. Restores ``state``'s
    module, sharded and optimizer state, scheduler and random generators in place; returns the
    checkpoint's path, the client state and the step counters to continue from (None with
    ``load_module_only``), which the caller applies."""
    group, rank = state.group, state.rank
    with_optimizer = load_optimizer_states and not load_module_only
    with_scheduler = load_lr_scheduler_states and not load_module_only

    def locate():
        path = layout.resolve(load_dir, tag)
        return path, layout.read_meta(path), _reader(path).read_metadata().state_dict_metadata

    path, meta, stored = agreed("load_checkpoint", locate, group)
    everywhere = _all_gather(os.path.realpath(path), group)

    def check():
        if len(set(everywhere)) > 1:
            raise CheckpointError(f"the ranks found different checkpoints: {everywhere}")
        view = _model_view(state)
        _check_model(path, meta, stored, view)
        if with_optimizer:
            _check_optimizer(path, meta, stored, state, view)
        if with_scheduler:
            _check_scheduler(path, meta, stored, state)
        return view

    view = agreed("load_checkpoint", check, group)
    # Nothing of the engine has changed so far: every error above leaves it as it was.

    # The small objects, read by every rank (the same keys everywhere, as DCP asks).
    keys = [k for k in (SCALARS, PARAM_GROUPS, ENGINE, CLIENT_STATE, LR_SCHEDULER) if k in stored]
    same_world = meta["world_size"] == state.world_size
    if same_world and not load_module_only:
        keys += [f"{RNG}{r}" for r in range(state.world_size) if f"{RNG}{r}" in stored]
    objects: Dict[str, Any] = dict.fromkeys(keys)
    plain = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    agreed(f"load_checkpoint: reading {path!r}",
           lambda: dcp.load(objects, storage_reader=_reader(path), planner=plain, process_group=group), group)

    def prepare_tensors():
        ranges, copies = [], []
        for s in view.shards:
            ranges.append(FlatRange(MODEL + s.name, s.numel, s.start, s.local))
        for name, p in view.whole.items():
            target = p.detach().view(-1) if p.is_contiguous() else torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            if not p.is_contiguous():
                copies.append((p, target))
            ranges.append(FlatRange(MODEL + name, p.numel(), 0, target))
        if with_optimizer:
            saved_state, scalars = meta["optimizer"]["state"], objects[SCALARS]
            state.sharding.reset_optimizer_state({
                s.ds_id: {**dict.fromkeys(saved_state[s.name]), **scalars.get(s.name, {})}
                for s in view.shards if s.name in saved_state
            })
            for s in view.shards:
                held = state.sharding.shard_optimizer_state(s.ds_id)
                for key in saved_state.get(s.name, []):
                    if key in held:  # a parameter the engine's optimizer does not train gets none
                        ranges.append(FlatRange(f"{OPTIM}{s.name}/{key}", s.numel, s.start, held[key]))
        return ranges, copies

    ranges, copies = agreed("load_checkpoint", prepare_tensors, group)
    buffers = {BUFFERS + n: b.detach() for n, b in view.buffers.items()}
    agreed(f"load_checkpoint: reading {path!r}",
           lambda: dcp.load(buffers, storage_reader=_reader(path), planner=FlatRangeLoadPlanner(ranges),
                            process_group=group), group)
    with torch.no_grad():
        for p, flat in copies:
            p.copy_(flat.view(p.shape))
    state.sharding.sync_params_from_shards()

    restored: List[StepCounters] = []  # the counters apply_state read, for the caller to apply

    def apply_state():
        if with_optimizer:
            for group_dict, saved in zip(state.optimizer.param_groups, objects[PARAM_GROUPS]):
                group_dict.update({k: v for k, v in saved.items() if k != "params"})
        if with_scheduler and state.lr_scheduler is not None:
            state.lr_scheduler.load_state_dict(objects[LR_SCHEDULER])
        if load_module_only:
            return
        counters = objects[ENGINE]
        global_steps = counters["global_steps"]
        # At a window boundary, in the current accumulation length (which may have changed).
        same_windows = counters["gradient_accumulation_steps"] == state.gradient_accumulation_steps
        # Checkpoints from before fp16 support have no skipped steps nor loss scale; one of a run
        # without loss scaling leaves an fp16 run's scale where the config starts it.
        restored.append(StepCounters(
            global_steps=global_steps,
            micro_steps=counters["micro_steps"] if same_windows else global_steps * state.gradient_accumulation_steps,
            skipped_steps=counters.get("skipped_steps", 0)))
        if counters.get("loss_scaler"):
            state.loss_scaler.load_state_dict(counters["loss_scaler"])
        if same_world:
            rng_state.restore(objects[f"{RNG}{rank}"], state.device)
        elif rank == 0:
            warnings.warn(f"checkpoint {path!r} was saved by {meta['world_size']} ranks, this run has "
                          f"{state.world_size}: the random number generators (per rank) are not restored", stacklevel=4)

    agreed("load_checkpoint", apply_state, group)
    return path, objects.get(CLIENT_STATE) or {}, (restored[0] if restored else None)
