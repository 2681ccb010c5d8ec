"""Hugging Face safetensors weights on disk: finding the files, reading exact pieces, writing shards.

A model's weights are either one ``model.safetensors`` or several files listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: file name}}``). Reading goes
through ``safe_open(...).get_slice``, which reads only the elements a slice covers; a flat range
of a tensor (what one rank owns of a parameter) becomes a few rectangular slices
(:func:`flat_range_blocks`), so a rank reads exactly its elements and nothing more.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

Index = Tuple[slice, ...]


class CheckpointFileError(ValueError):
    """The files cannot be read as Hugging Face safetensors weights."""


def _tensor_files(path: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The safetensors files behind ``path`` (a directory, one ``.safetensors`` file or an index
    file) and the index's weight map (None without an index)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX_FILE)):
            path = os.path.join(path, INDEX_FILE)
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            return [os.path.join(path, SINGLE_FILE)], None
        else:
            raise CheckpointFileError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{path} does not exist")
    if path.endswith(".safetensors"):
        return [path], None
    if not path.endswith(".json"):
        raise CheckpointFileError(f"{path} is neither a .safetensors file nor a safetensors index (.json)")
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"{path} is not a safetensors index with a weight_map: {e}") from e
    folder = os.path.dirname(path)
    files = sorted(set(weight_map.values()))
    absent = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
    if absent:
        raise CheckpointFileError(f"{path} lists files that do not exist: {', '.join(absent)}")
    return [os.path.join(folder, name) for name in files], weight_map


class SafetensorsWeights:
    """The tensors of a set of safetensors files, by name: shapes from the headers (nothing is
    read until asked) and reads of rectangular pieces."""

    def __init__(self, path: str):
        self.path = path
        files, weight_map = _tensor_files(path)
        self._handles = {}
        self.file_of: Dict[str, str] = {}
        self.shapes: Dict[str, torch.Size] = {}
        self.problems: List[str] = []  # inconsistencies between the index and the files
        for file in files:
            try:
                handle = safe_open(file, framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointFileError(f"{file} is not a readable safetensors file: {e}") from e
            self._handles[file] = handle
            for name in handle.keys():
                if name in self.file_of:
                    self.problems.append(f"{name} is stored twice ({os.path.basename(self.file_of[name])} "
                                         f"and {os.path.basename(file)})")
                    continue
                self.file_of[name] = file
                self.shapes[name] = torch.Size(handle.get_slice(name).get_shape())
        if weight_map is not None:
            for name, file in sorted(weight_map.items()):
                if name not in self.file_of:
                    self.problems.append(f"{name}: the index places it in {file}, which does not hold it")
                elif os.path.basename(self.file_of[name]) != file:
                    self.problems.append(f"{name}: the index places it in {file}, it is stored in "
                                         f"{os.path.basename(self.file_of[name])}")

    def names(self) -> List[str]:
        return sorted(self.file_of)

    def read(self, name: str, index: Index) -> torch.Tensor:
        """Elements ``index`` (one slice per dimension) of tensor ``name``; only they are read."""
        return self._handles[self.file_of[name]].get_slice(name)[index]

    def read_full(self, name: str) -> torch.Tensor:
        return self.read(name, tuple(slice(0, n) for n in self.shapes[name]))


def flat_range_blocks(shape: Sequence[int], start: int, end: int) -> List[Index]:
    """Rectangular pieces (one slice per dimension) that, flattened and laid end to end, are
    elements ``[start, end)`` of a row-major tensor of ``shape``: full rows where the range spans
    whole rows, and the partial rows at either end split the same way one dimension down. At most
    ``2 * len(shape) - 1`` pieces, never an element outside the range."""
    if start >= end:
        return []
    if len(shape) == 0:
        return [()]
    row = math.prod(shape[1:])
    first, head = divmod(start, row)
    last, tail = divmod(end, row)

    def within_row(r: int, lo: int, hi: int) -> List[Index]:
        return [(slice(r, r + 1),) + inner for inner in flat_range_blocks(shape[1:], lo, hi)]

    if first == last:
        return within_row(first, head, tail)
    blocks: List[Index] = []
    if head:
        blocks += within_row(first, head, row)
        first += 1
    if last > first:
        blocks.append((slice(first, last),) + tuple(slice(0, n) for n in shape[1:]))
    if tail:
        blocks += within_row(last, 0, tail)
    return blocks


# ---- writing ----------------------------------------------------------------------------------


def parse_size(size) -> int:
    """Bytes of ``size``: an int, or a string such as ``"5GB"`` (10**9) or ``"500MiB"`` (2**20)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size) if isinstance(size, str) else None
    if match is None or match.group(2).upper() not in units or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a string such as '5GB' or "
                         f"'500MiB'; got {size!r}")
    return int(float(match.group(1)) * units[match.group(2).upper()])


class ShardedWriter:
    """Writes tensors, one at a time, into files of at most ``max_bytes`` each (a tensor larger
    than that gets a file of its own), as ``save_pretrained`` names them: ``model.safetensors``
    when one file holds everything, else ``model-0000k-of-0000n.safetensors`` and the index. At
    most one file's worth of tensors is held in memory (the write buffer). A subclass writing
    another format sets the three names and :meth:`_save`."""

    single_file = SINGLE_FILE
    index_file = INDEX_FILE
    shard_file = "model-{number:05d}-of-{count:05d}.safetensors"

    def __init__(self, folder: str, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes
        self._buffer: Dict[str, torch.Tensor] = {}
        self._buffered_bytes = 0
        self._files: List[List[str]] = []  # tensor names of each written file, in order
        self.total_bytes = 0

    def _temporary_name(self, number: int) -> str:
        return os.path.join(self.folder, f"part-{number:05d}{os.path.splitext(self.single_file)[1]}")

    def _save(self, tensors: Dict[str, torch.Tensor], path: str) -> None:
        save_file(tensors, path, metadata={"format": "pt"})

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffered_bytes + nbytes > self.max_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().to("cpu").contiguous()
        self._buffered_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        self._save(self._buffer, self._temporary_name(len(self._files)))
        self._files.append(sorted(self._buffer))
        self._buffer, self._buffered_bytes = {}, 0

    def finish(self, total_parameters: int) -> List[str]:
        """Writes what is buffered, gives the files their final names and writes the index;
        returns the names of the files written."""
        if self._buffer or not self._files:
            self._flush()
        count = len(self._files)
        if count == 1:
            os.replace(self._temporary_name(0), os.path.join(self.folder, self.single_file))
            return [self.single_file]
        written, weight_map = [], {}
        for number, names in enumerate(self._files):
            final = self.shard_file.format(number=number + 1, count=count)
            os.replace(self._temporary_name(number), os.path.join(self.folder, final))
            weight_map.update({name: final for name in names})
            written.append(final)
        index = {"metadata": {"total_size": self.total_bytes, "total_parameters": total_parameters},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.folder, self.index_file), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2) + "\n")
        return written + [self.index_file]


def is_weights_file(name: str) -> bool:
    """Whether ``name`` (in a model folder) is one of the weight files an export writes."""
    return name in (SINGLE_FILE, INDEX_FILE) or SHARD_FILE.fullmatch(name) is not None

