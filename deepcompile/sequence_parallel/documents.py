"""Packed sequences under sequence parallelism: which document each token of the whole sequence
belongs to, and the kernel of ``dcsp::documents`` that hands it to the graphs.

A packed row holds several documents back to back, marked the way transformers marks them:
``position_ids`` restart (a token whose position is not its predecessor's + 1 starts a document,
transformers' ``find_packed_sequence_indices``). Attention must then stay inside each document.
The rank sees only its slice of the positions, so the engine gathers the group's slices before
every forward (:func:`global_documents`, from ``SequenceParallel.check_inputs``) and stores the
result under the group's key (:func:`publish`). The attention pass's graphs read it through
``dcsp::documents`` (schema and fake kernel: deepcompile/ops.py), which makes it an ordinary value
of the graph: saved for the backward like any other, and read again by a recompute (activation
checkpointing) of the same micro-step.

The three tensors (:class:`Documents`):

* ``ids`` ``[B, S]`` int32: each token's document index within its row (0, 1, ...);
* ``bounds`` ``[B * S + 1]`` int32: where each document starts in the flattened batch, then
  ``B * S``, padded with ``B * S`` to a fixed length (the graph's shapes cannot depend on the data),
  the ``cu_seqlens`` of variable-length attention kernels;
* ``counts`` ``[2]`` int64 on the host: the number of documents and the longest one's length, so
  kernels choose their path and size their launch without reading the device.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from deepcompile import ops


@dataclasses.dataclass(frozen=True)
class Documents:
    ids: torch.Tensor
    bounds: torch.Tensor
    counts: torch.Tensor

    @property
    def packed(self) -> bool:
        """Whether any row holds more than one document (host values only)."""
        return int(self.counts[0]) > self.ids.shape[0]


_PUBLISHED: Dict[int, Documents] = {}


def documents_of(positions: torch.Tensor) -> Documents:
    """The documents of whole-sequence ``positions`` ``[B, S]`` (transformers' rule: a document
    starts where a position is not its predecessor's + 1, and at the start of every row)."""
    batch, length = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    ids = (starts.to(torch.int32).cumsum(dim=1) - 1).to(torch.int32)
    first_tokens = starts.reshape(-1).nonzero().reshape(-1).to(torch.int32)
    total = batch * length
    bounds = torch.full((total + 1,), total, dtype=torch.int32, device=positions.device)
    bounds[:first_tokens.numel()] = first_tokens
    lengths = torch.diff(bounds[:first_tokens.numel() + 1])
    counts = torch.tensor([first_tokens.numel(), int(lengths.max())], dtype=torch.int64)  # one host read
    return Documents(ids, bounds, counts)


def global_positions(positions: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The whole sequences' ``[B, S]`` positions from every rank's ``[B, S / P]`` slice (the
    slices concatenated in rank order, which is sequence order)."""
    local = positions.contiguous()
    gathered = local.new_empty((size * local.shape[0], local.shape[1]))  # the ranks' slices stacked on dim 0
    dist.all_gather_into_tensor(gathered, local, group=group)
    return gathered.view(size, *local.shape).permute(1, 0, 2).reshape(local.shape[0], size * local.shape[1])


def new_key() -> int:
    """A key for documents published without sequence parallelism (``compile.packed_sequences`` on
    one rank of each sequence), from the same series as the groups' keys."""
    from deepcompile.sequence_parallel.all_to_all import new_key as next_key

    return next_key()


def publish(group_key: int, documents: Documents) -> None:
    """What ``dcsp::documents`` returns for this group until the next publish (one per forward)."""
    _PUBLISHED[group_key] = documents


def withdraw(group_key: int) -> None:
    _PUBLISHED.pop(group_key, None)


def _documents_kernel(like: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    documents = _PUBLISHED.get(group)
    if documents is None:
        raise RuntimeError(f"dcsp::documents: no documents published for sequence-parallel group {group} "
                           "(the engine publishes them before each forward; a graph called outside the engine "
                           "has none)")
    expected = (like.shape[0], like.shape[2])
    if tuple(documents.ids.shape) != expected:
        raise RuntimeError(f"dcsp::documents: the forward's whole sequences are {tuple(documents.ids.shape)} "
                           f"[batch, tokens], the attention call sees {expected}")
    # Copies: an op's outputs may not alias state the next forward replaces.
    return (documents.ids.to(like.device, copy=True), documents.bounds.to(like.device, copy=True),
            documents.counts.clone())


ops.register_documents_kernel(_documents_kernel)
