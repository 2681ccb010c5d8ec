"""Ulysses sequence parallelism: ``sequence_parallel_size`` ranks share every sequence.

* groups.py: which ranks share a sequence (consecutive ones), and the data-parallel replicas;
* all_to_all.py: the kernel of ``dcsp::all_to_all`` (the op itself: deepcompile/ops.py);
* attention.py: the graph pass that wraps every attention call in the all-to-alls;
* batch.py: this rank's slice of a batch (global positions, labels shifted before slicing);
* loss.py: the loss averaged over the whole sequence's tokens;
* documents.py and packed_attention.py: packed sequences (``compile.packed_sequences``), the
  forward's documents and attention kept inside them.

:class:`SequenceParallel` is what an engine holds (``engine.sequence_parallel``): the groups, the
key graphs reach the group by, and how many attention calls the pass rewrote.
docs/design/sequence-parallel.md describes the whole.
"""

from __future__ import annotations

import contextlib

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch.fx import GraphModule

from deepcompile.passes.causal_mask import uses_sliding_window
from deepcompile.sequence_parallel import all_to_all, documents, eager_guard, packed_attention  # noqa: F401 - kernels
from deepcompile.sequence_parallel.attention import SequenceParallelError, split_attention
from deepcompile.sequence_parallel.batch import shard_batch, shift_labels
from deepcompile.sequence_parallel.groups import SIZE_KEY, SequenceParallelGroups, build_groups, check_size
from deepcompile.sequence_parallel.loss import global_token_mean, gradient_factor

__all__ = ["SequenceParallel", "SequenceParallelError", "SequenceParallelGroups", "shard_batch", "shift_labels",
           "global_token_mean", "build_groups", "check_size", "SIZE_KEY"]


class SequenceParallel:
    """One engine's sequence parallelism (``size`` 1: off, every method a no-op)."""

    def __init__(self, groups: SequenceParallelGroups, packed: bool = False):
        self.groups = groups
        self.group_key = all_to_all.register_group(groups.group) if groups.enabled else 0
        # Attention calls outside the compiled graphs raise inside this engine's forward (eager_guard.py).
        self._guard_installed = groups.enabled
        if groups.enabled:
            eager_guard.install()
        self.rewritten_calls = 0  # attention calls the graph pass has rewritten so far
        # compile.packed_sequences: attention kept inside the documents of packed rows.
        self.packed = packed
        self.last_documents: Optional[documents.Documents] = None  # of the last forward (packed only)

    @property
    def enabled(self) -> bool:
        return self.groups.enabled

    @property
    def size(self) -> int:
        return self.groups.size

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def group(self):
        return self.groups.group

    def rewrite(self, gm: GraphModule) -> int:
        """The Ulysses pass over one captured graph (attention.py); returns the calls rewritten."""
        if not self.enabled:
            return 0
        count = split_attention(gm, self.size, self.group_key, self.packed)
        self.rewritten_calls += count
        return count

    def check_model(self, model: torch.nn.Module, routed: Sequence[str] = ()) -> None:
        """Refuse a model whose attention the pass would change: the pass replaces the mask
        transformers traces with plain causal attention over the whole sequence, which is wrong
        for sliding-window attention (Mistral's default, Gemma's and Qwen2's sliding layers).
        ``routed``: modules whose forward still routes through a hub kernel (compat/hub_kernels.py),
        named by the error of an attention call that then runs outside the graphs."""
        if not self.enabled:
            return
        if routed:
            eager_guard.note_cause(
                f"here the kernels package routes the forward of {routed[0]}{' and others' if len(routed) > 1 else ''} "
                "to a hub kernel, which Dynamo does not trace inside activation checkpointing")
        for name, module in model.named_modules():
            config = getattr(module, "config", None)
            if config is None or not hasattr(config, "to_dict"):
                continue
            if uses_sliding_window(config):
                raise SequenceParallelError(
                    f"sequence parallelism: {name or 'the model'} uses sliding-window attention (window "
                    f"{getattr(config, 'sliding_window', None)}); the attention pass gives every token the whole causal "
                    "prefix, so sliding windows are not supported yet. Use a model configuration without them")
            return  # the outermost config speaks for the model

    def check_inputs(self, args: Any, kwargs: Mapping[str, Any]) -> None:
        """Refuse a forward whose inputs the pass would get wrong (attention.py): a padding
        ``attention_mask``, ``position_ids`` missing or of another shape than the other ranks'
        slices, or other than this slice's global, consecutive ones (local, or packed sequences
        without compile.packed_sequences).

        The group decides together: every rank's verdict is exchanged before anyone raises, so
        either every rank of the group raises the same error, naming the ranks at fault, or none
        does (a rank refusing alone would leave the others inside the attention's all-to-all).
        Two small all-gathers and a host read."""
        if not self.enabled:
            return
        mask = kwargs.get("attention_mask")
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 1:
            positions = positions.unsqueeze(0)
        has_positions = isinstance(positions, torch.Tensor)
        padded = isinstance(mask, torch.Tensor) and not bool((mask == 1).all())
        rows, length = (positions.shape[0], positions.shape[-1]) if has_positions else (0, 0)
        header = torch.tensor([int(padded), int(has_positions), rows, length], dtype=torch.int64,
                              device=self._exchange_device(args, kwargs))
        headers = self._gather(header).tolist()
        problem = _header_problem(headers, self.groups.group_ranks)
        if problem is not None:
            raise SequenceParallelError(problem)
        if self.packed:
            self._publish_documents(positions)
            return
        # Per rank of the group: whether its slice is consecutive, and each row's first position.
        # Slice r must start r * length after slice 0 (contiguous, in rank order, numbered
        # globally). Every rank sees every rank's values, so all decide the same.
        consecutive = (positions.diff(dim=-1) == 1).all() if length > 1 else torch.tensor(True)
        mine = torch.cat([consecutive.to(positions.device, positions.dtype).reshape(1), positions[:, 0]])
        gathered = self._gather(mine.to(header.device, torch.int64))
        offsets = torch.arange(self.size, device=gathered.device).unsqueeze(-1) * length
        firsts = gathered[:, 1:]
        wrong = [r for r in range(self.size)
                 if not bool(gathered[r, 0]) or not bool((firsts[r] == firsts[0] + offsets[r]).all())]
        if wrong:
            raise SequenceParallelError(
                f"sequence parallelism: {_ranks(wrong, self.groups.group_ranks)} of the group hold position_ids that "
                f"are not their slice of each sequence: rank r of {self.size} must hold positions "
                f"[start + r * {length}, start + (r + 1) * {length}), consecutive, with the slices in rank order "
                "(engine.sequence_parallel.shard makes them); a slice numbered from 0 on every rank is not supported, "
                "and packed sequences (positions restarting inside a row) need compile.packed_sequences")

    def _gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` (the same shape on each), stacked in group order."""
        gathered = values.new_empty(self.size * values.numel())
        torch.distributed.all_gather_into_tensor(gathered, values.contiguous(), group=self.group)
        return gathered.view(self.size, values.numel())

    def _exchange_device(self, args: Any, kwargs: Mapping[str, Any]) -> torch.device:
        """Where the group's verdicts travel: the inputs' device (the communicator's)."""
        for value in (*kwargs.values(), *args):
            if isinstance(value, torch.Tensor):
                return value.device
        if torch.distributed.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _publish_documents(self, positions: torch.Tensor) -> None:
        """compile.packed_sequences: the whole sequences' documents, from every rank's positions,
        for the attention op of this forward (documents.py). One all-gather of the positions and
        one host read."""
        whole = documents.global_positions(positions, self.group, self.size)
        length = positions.shape[-1]
        numbered_per_slice = torch.arange(length, device=whole.device).repeat(self.size)
        if self.size > 1 and bool((whole == numbered_per_slice).all()):
            raise SequenceParallelError(
                f"sequence parallelism: every rank's slice is numbered from 0 (positions 0..{length - 1}); the "
                "positions must be the whole sequence's (engine.sequence_parallel.shard makes them). Documents of "
                "exactly one slice's length cannot be told from that mistake: pad one of them")
        self.last_documents = documents.documents_of(whole)
        documents.publish(self.group_key, self.last_documents)

    def shard(self, batch: Mapping[str, Any], pad_token_id: int = 0) -> Dict[str, Any]:
        """This rank's slice of a batch of whole sequences (batch.py); the batch as it is when off."""
        return shard_batch(batch, self.rank, self.size, pad_token_id) if self.enabled else dict(batch)

    def loss(self, loss: torch.Tensor, shift_labels: Optional[torch.Tensor]) -> torch.Tensor:
        """The mean over the whole sequence's tokens, from this slice's mean (loss.py); ``loss``
        itself when off (``shift_labels`` may then be None: an unsharded batch has none)."""
        if not self.enabled:
            return loss
        if shift_labels is None:
            raise ValueError("sequence parallelism: loss() needs the slice's shift_labels (from shard())")
        return global_token_mean(loss, shift_labels, self.group)

    def gradient_factor(self, loss: torch.Tensor) -> int:
        """The multiplier of this rank's loss before its backward (loss.py): 1 for a loss every
        rank holds whole (combined through a differentiable collective), the group's size for
        this rank's share of it; 1 when off."""
        return gradient_factor(loss, self.size) if self.enabled else 1

    def guarding(self):
        """Around the forward: an attention call that runs outside the compiled graphs raises
        (eager_guard.py); nothing when off."""
        return eager_guard.guarding() if self.enabled else contextlib.nullcontext()

    def close(self) -> None:
        if self._guard_installed:
            self._guard_installed = False
            eager_guard.uninstall()
        if self.group_key:
            documents.withdraw(self.group_key)
            all_to_all.unregister_group(self.group_key)
            self.group_key = 0


def _ranks(indices: List[int], group_ranks: List[int]) -> str:
    """``rank 1 (global 3)`` or ``ranks 0, 1 (global 2, 3)``: the group's ranks at fault."""
    local = ", ".join(str(i) for i in indices)
    return f"rank{'s' if len(indices) > 1 else ''} {local} (global {', '.join(str(group_ranks[i]) for i in indices)})"


def _header_problem(headers: List[List[int]], group_ranks: List[int]) -> Optional[str]:
    """The refusal every rank of the group raises, from every rank's ``[padded, has_positions,
    rows, length]``, or None when the slices agree."""
    padded = [r for r, h in enumerate(headers) if h[0]]
    if padded:
        return (f"sequence parallelism: {_ranks(padded, group_ranks)} of the group got an attention_mask with padding, "
                "which cannot be split over ranks; pack or pad at the end without a mask "
                "(engine.sequence_parallel.shard does)")
    missing = [r for r, h in enumerate(headers) if not h[1]]
    if missing:
        return (f"sequence parallelism: {_ranks(missing, group_ranks)} of the group got no position_ids; the forward "
                "needs each slice's global position_ids (the model would number each slice from 0); split batches "
                "with engine.sequence_parallel.shard(batch)")
    shapes = {(h[2], h[3]) for h in headers}
    if len(shapes) > 1:
        held = "; ".join(f"rank {r}: {h[2]} rows of {h[3]} tokens" for r, h in enumerate(headers))
        return (f"sequence parallelism: the group's slices differ in shape ({held}); every rank must hold an "
                "equal slice of the same sequences (engine.sequence_parallel.shard pads the length to a multiple of "
                "the group's size)")
    return None
