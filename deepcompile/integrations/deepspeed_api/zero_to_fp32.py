"""``deepspeed.utils.zero_to_fp32``: the full fp32 weights of a checkpoint of
``engine.save_checkpoint``, read in one process without a process group or GPU.

DeepSpeed users call these on the ``save_dir`` of a training run (``tag=None``: the checkpoint the
``latest`` file names). Here they read deepcompile's checkpoints (any saving world size, any ZeRO
stage) through the same offline reader as ``deepcompile export`` (checkpoint/offline.py):

* :func:`get_fp32_state_dict_from_zero_checkpoint`: ``{name: tensor}`` on the CPU, parameters as
  fp32 (the fp32 master weights; a parameter stored in another floating dtype is cast to fp32),
  persistent buffers in their own dtype. A tied parameter appears once, under the name the
  checkpoint stores it by (DeepSpeed lists it under each name; :func:`load_state_dict_from_zero_checkpoint`
  fills the other names from the model it is given).
* :func:`convert_zero_checkpoint_to_fp32_state_dict`: that dict written into ``output_dir`` as
  Hugging Face names it: ``pytorch_model.bin`` (``torch.save``) or, with ``safe_serialization``,
  ``model.safetensors``; over ``max_shard_size``, numbered files and their ``.index.json``. The
  checkpoint is read and written a batch at a time, not held whole.
* :func:`load_state_dict_from_zero_checkpoint`: the weights loaded into ``model`` (moved to the CPU).

Refused with an error, never ignored: ``lazy_mode=True`` (the dict is built eagerly; use
:func:`convert_zero_checkpoint_to_fp32_state_dict` for a model larger than host memory) and
``exclude_frozen_parameters=True`` (a deepcompile checkpoint does not record which parameters
were trainable).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections import OrderedDict
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from deepcompile.checkpoint.offline import OfflineCheckpoint, StoredTensor
from deepcompile.checkpoint.safetensors_files import ShardedWriter, is_weights_file, parse_size
from deepcompile.integrations.deepspeed_api._missing import module_getattr, refused
from deepcompile.integrations.deepspeed_api.ds_logging import logger

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]

_BIN_SINGLE = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"


class _TorchBinWriter(ShardedWriter):
    """:class:`ShardedWriter`'s shards as ``torch.save`` files, named as transformers names them."""

    single_file = _BIN_SINGLE
    index_file = _BIN_INDEX
    shard_file = "pytorch_model-{number:05d}-of-{count:05d}.bin"

    def _save(self, tensors: Dict[str, torch.Tensor], path: str) -> None:
        torch.save(tensors, path)


def _refuse_unsupported(where: str, exclude_frozen_parameters: bool, lazy_mode: bool = False) -> None:
    if exclude_frozen_parameters:
        raise refused(f"deepspeed.utils.zero_to_fp32.{where}(exclude_frozen_parameters=True) (a deepcompile "
                      "checkpoint does not record which parameters were trainable)",
                      "leave it False and drop the frozen names from the result yourself (those whose parameter "
                      "has requires_grad=False in your model)")
    if lazy_mode:
        raise refused(f"deepspeed.utils.zero_to_fp32.{where}(lazy_mode=True) (the state dict is built eagerly)",
                      "leave it False, or, for a model larger than host memory, write the weights to files with "
                      "convert_zero_checkpoint_to_fp32_state_dict (read a batch at a time) or `deepcompile export`")


def _tensors(checkpoint_dir: Any, tag: Any) -> Iterator[Tuple[StoredTensor, torch.Tensor]]:
    """The checkpoint's parameters (floating ones as fp32) and buffers, full, a batch at a time."""
    ckpt = OfflineCheckpoint(checkpoint_dir, tag)
    logger.info(f"reading {ckpt.describe()}")
    for stored, value in ckpt.read():
        if stored.is_parameter and value.is_floating_point() and value.dtype != torch.float32:
            value = value.to(torch.float32)
        yield stored, value


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: Any, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The full state dict of checkpoint ``tag`` in ``checkpoint_dir`` (``None``: the one named by
    ``checkpoint_dir/latest``): fp32 parameters and the persistent buffers, on the CPU."""
    _refuse_unsupported("get_fp32_state_dict_from_zero_checkpoint", exclude_frozen_parameters, lazy_mode)
    return OrderedDict((stored.name, value) for stored, value in _tensors(checkpoint_dir, tag))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_dir: Any, max_shard_size: Any = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write :func:`get_fp32_state_dict_from_zero_checkpoint`'s dict into ``output_dir`` (created):
    ``pytorch_model.bin``, or ``model.safetensors`` with ``safe_serialization``; files of at most
    ``max_shard_size`` (bytes, or a string such as ``"5GB"``), numbered and listed by an index
    json when one is not enough. Weight files of that format already in ``output_dir`` are
    replaced; the new ones appear only once all are written."""
    _refuse_unsupported("convert_zero_checkpoint_to_fp32_state_dict", exclude_frozen_parameters)
    max_bytes = parse_size(max_shard_size)
    output_dir = os.fspath(output_dir)
    tensors = _tensors(checkpoint_dir, tag)
    first = next(tensors, None)  # opens the checkpoint (and raises on a bad one) before output_dir is touched
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".zero_to_fp32-", dir=output_dir)
    try:
        writer = (ShardedWriter if safe_serialization else _TorchBinWriter)(staging, max_bytes)
        parameters = 0
        for stored, value in itertools.chain([first] if first is not None else [], tensors):
            writer.add(stored.name, value)
            parameters += value.numel() if stored.is_parameter else 0
        files = writer.finish(parameters)
        for name in os.listdir(output_dir):  # an earlier conversion's files of this format
            if name != os.path.basename(staging) and _is_output_file(name, safe_serialization):
                os.remove(os.path.join(output_dir, name))
        for name in files:
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"wrote the fp32 weights ({parameters:,} parameters) to {output_dir}: {', '.join(files)}")


def _is_output_file(name: str, safe_serialization: bool) -> bool:
    if safe_serialization:
        return is_weights_file(name)
    return name in (_BIN_SINGLE, _BIN_INDEX) or (name.startswith("pytorch_model-") and name.endswith(".bin"))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: Any, tag: Optional[str] = None):
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it, and return it.

    Names of a tied parameter that the checkpoint stores under another of its names are filled
    from that one. Any other name the model has and the checkpoint lacks, or the checkpoint has
    and the model lacks, is an error raised before anything is loaded (a checkpoint of another
    model), not skipped as DeepSpeed's ``strict=False`` load skips it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    aliases: Dict[int, list] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        stored = [n for n in names if n in state]
        for n in names:
            if stored and n not in state:
                state[n] = state[stored[0]]
    wanted = set(model.state_dict().keys())
    missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or unexpected:  # checked before anything is loaded: the model is left as it was
        raise RuntimeError(
            f"deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint: the checkpoint in {checkpoint_dir!r} "
            f"does not match the model (missing from the checkpoint: {missing[:20]}; not in the model: "
            f"{unexpected[:20]}); the model was not changed")
    model = model.cpu()
    model.load_state_dict(state, strict=True)
    return model


__getattr__ = module_getattr("deepspeed.utils.zero_to_fp32")
