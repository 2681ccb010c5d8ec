"""Hugging Face weights in and out of an engine: ``load_hf_weights`` and ``Engine.save_hf``.

Loading into an engine: every rank opens the safetensors headers (no tensor data), checks that
the files match the module (every parameter and persistent buffer present with the module's
shape; nothing else in the files unless ``strict=False``), and the ranks agree on the verdict
before any of them raises, so that a bad file stops all ranks together with one message. Then
each rank reads only its own elements of each parameter (``Sharding.shards()``: a flat range,
read as a few rectangular ``get_slice`` pieces) into its fp32 master weights, and one
``sync_params_from_shards`` makes the module compute with them. Buffers, and in ZeRO-1/2 the
parameters the optimizer does not hold, are replicated: every rank reads them whole.

Exporting: the parameters are gathered one at a time to rank 0 (``Sharding.full_params``), in
the model's training dtype, and written by rank 0 into ``save_pretrained``-style files of at
most ``max_shard_size`` each, in a staging folder next to the destination that replaces it only
once everything is written: a failed export leaves an earlier one where it was.

Names in the files are the module's ``state_dict`` names; tied parameters are stored once (under
their first name) and load from whichever of their names the files hold. For transformers models
whose checkpoint format differs from the module (fused MoE experts), ``checkpoint/hf_layout.py``
translates.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
import warnings
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile.checkpoint.hf_layout import Conversion, Source, Stored, conversion_for, transformers_conversions
from deepcompile.checkpoint.safetensors_files import (CheckpointFileError, SafetensorsWeights, ShardedWriter,
                                                       flat_range_blocks, is_weights_file, parse_size)
from deepcompile.checkpoint.training_state import HoldsTrainingState, TrainingState

DEFAULT_MAX_SHARD_SIZE = "5GB"


class HFWeightsError(ValueError):
    """Files that do not match the model, or an export that failed; raised on every rank."""


@dataclasses.dataclass
class _Entry:
    """One tensor of the module's state: a parameter (all its names, when tied) or a buffer."""

    names: List[str]
    tensor: torch.Tensor
    is_parameter: bool

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape


def _module_entries(module: nn.Module) -> List[_Entry]:
    """Every tensor of ``module.state_dict()`` once, in its order, with all of its names."""
    params = {id(p) for p in module.parameters()}
    entries: Dict[int, _Entry] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue  # extra state of a module: not a tensor the files could hold
        entries.setdefault(id(value), _Entry([], value, id(value) in params)).names.append(name)
    return list(entries.values())


# ---- agreeing across ranks ----------------------------------------------------------------------


def _agree(problems: List[str], group: Optional[dist.ProcessGroup]) -> List[str]:
    """Every rank's problems, on every rank (a problem seen by some ranks only says which)."""
    world = dist.get_world_size(group)
    everyone: List[List[str]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, problems, group=group)
    merged: List[str] = []
    for seen in everyone:
        for problem in seen:
            ranks = [r for r, theirs in enumerate(everyone) if problem in theirs]
            text = problem if len(ranks) == world else f"{problem} (seen on rank {', '.join(map(str, ranks))})"
            if text not in merged:
                merged.append(text)
    return merged


def _raise_if_any(problems: Sequence[str], what: str) -> None:
    if problems:
        raise HFWeightsError(f"{what}:\n  " + "\n  ".join(problems))


# ---- matching the files to the module -----------------------------------------------------------


def _plan(entries: List[_Entry], weights: SafetensorsWeights, conversions: List[Conversion],
          strict: bool) -> Tuple[List[Tuple[_Entry, Source]], List[str]]:
    """Where each entry is read from, and every problem found (empty: the files fit)."""
    shapes = weights.shapes
    plan, used = [], set()
    missing, wrong_shape, problems = [], [], list(weights.problems)
    for entry in entries:
        present = [n for n in entry.names if n in shapes]
        # Tied parameters: any of their names will do; the others, if stored too, are not read
        # but must fit as well.
        for name in present:
            if shapes[name] != entry.shape:
                wrong_shape.append(f"{name} {tuple(shapes[name])} (the model's is {tuple(entry.shape)})")
        used.update(present)
        if present:
            plan.append((entry, Stored(present[0])))
            continue
        conversion = next((c for c in (conversion_for(n, conversions) for n in entry.names) if c), None)
        if conversion is None or conversion.unsupported or entry.tensor.dim() == 0:
            hint = (f"; transformers stores it converted ({conversion.unsupported}), which load_hf_weights cannot "
                    "read" if conversion is not None and conversion.unsupported else "")
            missing.append(" / ".join(entry.names) + hint)
            continue
        source = conversion.source(entry.names[0], entry.shape)
        stored = source.names()
        absent = [n for n in stored if n not in shapes]
        used.update(n for n in stored if n in shapes)
        if absent:
            missing.append(f"{entry.names[0]} (stored as {len(stored)} tensors {stored[0]} ...; "
                           f"absent: {', '.join(absent)})")
            continue
        try:
            shape = source.shape(shapes)
        except ValueError as e:
            wrong_shape.append(f"{entry.names[0]}: {e}")
            continue
        if shape != entry.shape:
            wrong_shape.append(f"{entry.names[0]} {tuple(shape)} from {stored[0]} ... (the model's is "
                               f"{tuple(entry.shape)})")
            continue
        plan.append((entry, source))
    unexpected = sorted(set(shapes) - used)
    if missing:
        problems.append("missing from the files: " + ", ".join(missing))
    if wrong_shape:
        problems.append("wrong shape: " + ", ".join(wrong_shape))
    if unexpected and strict:
        problems.append("not in the model (strict=False accepts them): " + ", ".join(unexpected))
    elif unexpected:
        warnings.warn(f"load_hf_weights({weights.path}): tensors not in the model were ignored: "
                      f"{', '.join(unexpected)}", stacklevel=3)
    return plan, problems


def _read_range(source: Source, weights: SafetensorsWeights, shape: torch.Size, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened tensor, reading nothing else."""
    pieces = [source.read(weights, block).reshape(-1) for block in flat_range_blocks(shape, start, end)]
    return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


def _read_full(source: Source, weights: SafetensorsWeights, shape: torch.Size) -> torch.Tensor:
    return source.read(weights, tuple(slice(0, n) for n in shape)).reshape(shape)


# ---- loading --------------------------------------------------------------------------------------


def load_hf_weights(engine_or_model, path: Union[str, os.PathLike], *, strict: bool = True) -> None:
    """Load Hugging Face safetensors weights into an engine or a plain module.

    ``path``: a folder holding ``model.safetensors`` or ``model.safetensors.index.json`` (and its
    files), one ``.safetensors`` file, or an index file. Every parameter and persistent buffer of
    the module must be in the files with the module's shape (values are cast to the module's
    dtypes). Tensors the module does not have are an error, as in ``load_state_dict(strict=True)``;
    ``strict=False`` ignores them with a warning. Missing and misshapen tensors are always an
    error, raised before anything is loaded and naming every offending tensor.

    An engine (collective: every rank calls it): each rank reads only its own elements of every
    partitioned parameter; the ranks raise together. A plain ``nn.Module`` (not yet given to
    ``deepcompile.initialize``): read whole, in this process alone.
    """
    path = os.fspath(path)
    if isinstance(engine_or_model, HoldsTrainingState):  # an engine
        _load_into_engine(engine_or_model.training_state(), path, strict)
    elif isinstance(engine_or_model, nn.Module):
        _load_into_module(engine_or_model, path, strict)
    else:
        raise TypeError(f"load_hf_weights needs a deepcompile Engine or an nn.Module, got {type(engine_or_model).__name__}")


def _open_and_plan(module: nn.Module, path: str, strict: bool):
    try:
        weights = SafetensorsWeights(path)
    except CheckpointFileError as e:
        return None, None, [str(e)]
    plan, problems = _plan(_module_entries(module), weights, transformers_conversions(module), strict)
    return weights, plan, problems


def _load_into_module(module: nn.Module, path: str, strict: bool) -> None:
    # ZeRO-3 parameters carry ds_id, ZeRO-1/2 ones _dc_z12_id (their optimizer holds flat masters).
    partitioned = [n for n, p in module.named_parameters() if hasattr(p, "ds_id") or hasattr(p, "_dc_z12_id")]
    if partitioned:
        raise TypeError("load_hf_weights: this module's parameters are partitioned by a deepcompile engine "
                        f"({partitioned[0]} ...); pass the engine instead")
    weights, plan, problems = _open_and_plan(module, path, strict)
    _raise_if_any(problems, f"load_hf_weights({path}): the files do not match the model; nothing was loaded")
    with torch.no_grad():
        for entry, source in plan:
            entry.tensor.copy_(_read_full(source, weights, entry.shape))


def _load_into_engine(state: TrainingState, path: str, strict: bool) -> None:
    module, sharding, group = state.module, state.sharding, state.group
    weights, plan, problems = _open_and_plan(module, path, strict)
    _raise_if_any(_agree(problems, group), f"load_hf_weights({path}): the files do not match the model; "
                                           "nothing was loaded")
    shard_of = {id(module.get_parameter(s.name)): s for s in sharding.shards()}
    failure: List[str] = []
    try:
        with torch.no_grad():
            for entry, source in plan:
                shard = shard_of.get(id(entry.tensor))
                if shard is not None:
                    if shard.end > shard.start:
                        shard.local.copy_(_read_range(source, weights, entry.shape, shard.start, shard.end))
                elif hasattr(entry.tensor, "ds_id") and state.stage == 3:
                    raise RuntimeError(f"{entry.names[0]} is partitioned but not listed by the stage's shards()")
                else:  # replicated: a buffer, or a ZeRO-1/2 parameter the optimizer does not hold
                    entry.tensor.copy_(_read_full(source, weights, entry.shape))
    except Exception as e:  # an I/O error mid-way: every rank must still stop together
        failure.append(f"{type(e).__name__}: {e}")
    _raise_if_any(_agree(failure, group), f"load_hf_weights({path}): reading failed after the files were checked; "
                                          "the model is partly loaded")
    sharding.sync_params_from_shards()


# ---- exporting ------------------------------------------------------------------------------------


def _stored_tensors(name: str, full: torch.Tensor, conversions: List[Conversion]):
    """What ``save_pretrained`` would store for parameter ``name``: itself, or its pieces in
    transformers' checkpoint format."""
    conversion = conversion_for(name, conversions)
    if conversion is None:
        return [(name, full)]
    return list(conversion.split(name, full))


def _training_dtype(module: nn.Module) -> Optional[torch.dtype]:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def write_hf_config(module: nn.Module, folder: str) -> None:
    """config.json (and generation_config.json) of a transformers model, naming its class and
    training dtype as ``save_pretrained`` does, so that ``from_pretrained`` rebuilds it."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]
    dtype = _training_dtype(module)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    config.save_pretrained(folder)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(folder)


def _staging_folder(directory: str) -> str:
    """A new empty folder next to ``directory`` (same file system: renames are atomic)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory} exists and is not a folder")
    parent = os.path.dirname(directory) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.saving-", dir=parent)


def _move_into_place(staging: str, directory: str) -> None:
    """``staging`` becomes ``directory``. An existing ``directory`` is renamed aside first; what it
    held besides an earlier export's weights (a tokenizer, a README) moves into the new one, and
    only then is the earlier export deleted."""
    if not os.path.exists(directory):
        os.replace(staging, directory)
        return
    previous = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.previous-", dir=os.path.dirname(directory) or ".")
    os.rmdir(previous)
    os.replace(directory, previous)
    os.replace(staging, directory)
    new = set(os.listdir(directory))
    for entry in os.listdir(previous):
        if entry not in new and not is_weights_file(entry):
            os.replace(os.path.join(previous, entry), os.path.join(directory, entry))
    shutil.rmtree(previous)


def save_hf(state: TrainingState, directory: Union[str, os.PathLike], *,
            max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write the model of ``state`` (an engine's) as ``save_pretrained`` does (see ``Engine.save_hf``).
    Collective."""
    directory = os.path.abspath(os.fspath(directory))
    max_bytes = parse_size(max_shard_size)
    module, sharding, group = state.module, state.sharding, state.group
    conversions = transformers_conversions(module)
    entries = _module_entries(module)
    # Refused the same way on every rank before anything is gathered: the module decides it.
    blocked = [f"{e.names[0]}: {c.unsupported}" for e in entries
               for c in [conversion_for(e.names[0], conversions)] if c is not None and c.unsupported]
    _raise_if_any(blocked, "save_hf: transformers stores these parameters converted in a way save_hf cannot write")

    writing = dist.get_rank(group) == 0
    problems: List[str] = []
    staging, writer = None, None
    if writing:
        try:
            staging = _staging_folder(directory)
            writer = ShardedWriter(staging, max_bytes)
        except OSError as e:
            problems.append(f"{type(e).__name__}: {e}")
    entry_of = {id(e.tensor): e for e in entries}
    gathered = set()
    # Every rank takes part in every gather, even once rank 0 has failed: none is left waiting.
    for shard, full in sharding.full_params():
        entry = entry_of[id(module.get_parameter(shard.name))]
        gathered.add(id(entry.tensor))
        # Under hybrid sharding every shard group's first rank receives the full tensor; the
        # world's rank 0 alone writes.
        if full is None or not writing or problems:
            continue
        try:
            for name, tensor in _stored_tensors(entry.names[0], full, conversions):
                writer.add(name, tensor)
        except Exception as e:
            problems.append(f"writing {entry.names[0]}: {type(e).__name__}: {e}")
        del full
    if writing and not problems:
        try:
            with torch.no_grad():
                for entry in entries:  # replicated, whole on rank 0: buffers, ZeRO-1/2 frozen parameters
                    if id(entry.tensor) not in gathered:
                        for name, tensor in _stored_tensors(entry.names[0], entry.tensor.detach(), conversions):
                            writer.add(name, tensor)
            writer.finish(sum(e.tensor.numel() for e in entries if e.is_parameter))
            write_hf_config(module, staging)
            _move_into_place(staging, directory)
            staging = None
        except Exception as e:
            problems.append(f"{type(e).__name__}: {e}")
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    _raise_if_any(_agree(problems, group), f"save_hf({directory}) failed; an earlier export there is unchanged")
