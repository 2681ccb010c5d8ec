"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's ALST / Ulysses entry points
as accelerate (``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``) and Hugging Face
Trainer call them, served over deepcompile's sequence parallelism (deepcompile/sequence_parallel/).

* :meth:`UlyssesSPAttentionHF.register_with_transformers` makes the sequence-parallel groups
  (``deepcompile.sequence_parallel.build_groups``: ``P`` consecutive ranks per sequence, the same
  groups the engine uses) and checks the model; it returns an :class:`SequenceParallelMPU`, which
  the served ``deepspeed.initialize(mpu=...)`` turns into the config's ``sequence_parallel_size``.
  Nothing is registered with transformers: deepcompile's Ulysses is a graph pass over the
  compiled model's ``scaled_dot_product_attention`` calls, so only ``"sdpa"`` attention is
  supported (DeepSpeed's flash-attention, flex-attention and hub-kernel wrappers are refused).
* :class:`UlyssesSPDataLoaderAdapter` gathers the group's batches and hands each rank its slice of
  each of them in turn (rank order), so the loader is ``P`` times longer; the slices are
  ``deepcompile.sequence_parallel.shard_batch``'s (global ``position_ids``, ``shift_labels``).

Differences from DeepSpeed, each deliberate: ``disable_in_eval`` defaults to True and False is
refused (the served engine runs an evaluation forward, under ``model.eval()`` or
``torch.no_grad()``, on the model itself, outside the compiled graph and so without the pass: each
rank must then be given whole sequences, as Trainer's evaluation loader does); a sequence whose
length does not divide by ``P`` is padded at its end (labels -100) instead of refused; a batch
without ``position_ids`` gets ``0..S-1``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.sequence_parallel import SequenceParallelGroups, build_groups, shard_batch

SUPPORTED_ATTENTION = "sdpa"
# The keys a batch may carry as tensors: those shard_batch knows how to slice (or drop: an
# all-ones attention_mask). Any other tensor would reach the model whole on every rank.
_BATCH_TENSORS = ("input_ids", "inputs_embeds", "position_ids", "labels", "shift_labels", "attention_mask")


def _world_key() -> int:
    return id(dist.group.WORLD)


class SequenceParallelMPU:
    """What ``register_with_transformers`` returns (DeepSpeed's Megatron-style ``mpu``).

    * sequence parallel: the ``P`` consecutive ranks that share each sequence;
    * data parallel: the replicas that see different batches, Megatron's meaning: the ranks with
      the same sequence-parallel rank (``W / P`` of them);
    * sequence-data parallel: the whole world, what ZeRO partitions over (as DeepSpeed's ALST
      does, and as deepcompile's engine does with ``sequence_parallel_size``).

    ``micro_batch_size`` and ``seq_length`` (None when variable) are what registration was given:
    the served ``deepspeed.initialize`` checks the first against the config, the data-loader
    adapter the second against every batch."""

    def __init__(self, groups: SequenceParallelGroups, data_parallel_group: Optional[dist.ProcessGroup],
                 micro_batch_size: Optional[int], seq_length: Optional[int]):
        self.groups = groups
        self._data_parallel_group = data_parallel_group
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.world_key = _world_key()

    def _live(self) -> SequenceParallelGroups:
        if self.world_key != _world_key():
            raise RuntimeError("deepspeed sequence-parallel mpu: torch.distributed was re-initialized since "
                               "UlyssesSPAttentionHF.register_with_transformers made these groups; register again")
        return self.groups

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self._live().group

    def get_sequence_parallel_world_size(self) -> int:
        return self._live().size

    def get_sequence_parallel_rank(self) -> int:
        return self._live().rank

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        self._live()
        return self._data_parallel_group

    def get_data_parallel_world_size(self) -> int:
        return self._live().data_parallel_size

    def get_data_parallel_rank(self) -> int:
        return self._live().data_parallel_rank

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        self._live()
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        self._live()
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        self._live()
        return dist.get_rank()


# The data-parallel groups made so far, per default group and size (new_group is collective:
# made once, by every rank), and the mpu registration made last (deepspeed.utils.groups reads it).
_DATA_PARALLEL_GROUPS: Dict[Tuple[int, int], Optional[dist.ProcessGroup]] = {}
_registered: Optional[SequenceParallelMPU] = None


def registered() -> Optional[SequenceParallelMPU]:
    """The mpu of the last ``register_with_transformers`` under the current default group, if any."""
    if _registered is not None and _registered.world_key == _world_key():
        return _registered
    return None


def _data_parallel_group(groups: SequenceParallelGroups) -> Optional[dist.ProcessGroup]:
    key = (_world_key(), groups.size)
    if key not in _DATA_PARALLEL_GROUPS:
        world, mine = dist.get_world_size(), None
        for sp_rank in range(groups.size):
            group = dist.new_group(list(range(sp_rank, world, groups.size)))
            if sp_rank == groups.rank:
                mine = group
        _DATA_PARALLEL_GROUPS[key] = mine
    return _DATA_PARALLEL_GROUPS[key]


def _positive_int(name: str, value: Any, allow_none: bool) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"UlyssesSPAttentionHF.register_with_transformers: {name} must be a positive integer"
                         f"{' or None' if allow_none else ''}, got {value!r}")
    return value


def _model_config(model_name_or_path: Any) -> Any:
    """The model's config: its own for a model object (its attention implementation checked), or
    the config alone (``AutoConfig.from_pretrained``, no weights) for a name or path."""
    if isinstance(model_name_or_path, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_name_or_path)
    config = getattr(model_name_or_path, "config", None)
    if config is None:
        raise TypeError("UlyssesSPAttentionHF.register_with_transformers: model_name_or_path must be a Hugging Face "
                        f"model (an object with a config) or a model name/path, got {type(model_name_or_path)}")
    attention = getattr(config, "_attn_implementation", None)
    if attention is not None and attention != SUPPORTED_ATTENTION:
        raise ValueError(
            f"UlyssesSPAttentionHF.register_with_transformers: the model runs attn_implementation={attention!r}; "
            "deepcompile's sequence parallelism splits torch.nn.functional.scaled_dot_product_attention calls only: "
            "load the model with attn_implementation=\"sdpa\"")
    return config


class UlyssesSPAttentionHF:
    """DeepSpeed's Ulysses attention for transformers, served: only its registration entry point.
    The all-to-alls themselves are inserted by deepcompile's graph pass when the engine compiles."""

    def __init__(self, *args: Any, **kwargs: Any):
        from deepcompile.integrations.deepspeed_api._missing import refused

        raise refused("UlyssesSPAttentionHF as a module (DeepSpeed's attention wrapper)",
                      "call UlyssesSPAttentionHF.register_with_transformers(...) and pass its mpu to "
                      "deepspeed.initialize; deepcompile's compiler inserts the all-to-alls around SDPA")

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: Optional[int],
                                   seq_length: Optional[int] = None, seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = True, max_length: Optional[int] = None,
                                   **unsupported: Any) -> Optional[SequenceParallelMPU]:
        """The sequence-parallel groups for ``sequence_parallel_size`` ranks per sequence, as an
        mpu for ``deepspeed.initialize(mpu=...)``; None when the size is 1 (as DeepSpeed).

        ``model_name_or_path``: a model (its ``attn_implementation`` must be ``"sdpa"``) or a
        name/path (only its config is loaded, to check the head count; the attention the model is
        then loaded with is checked by the engine at the first forward). ``max_length``:
        DeepSpeed's deprecated name of ``seq_length``. ``disable_in_eval``: True only (the module's
        doc says why)."""
        global _registered
        if unsupported:
            raise TypeError(f"UlyssesSPAttentionHF.register_with_transformers: unexpected arguments "
                            f"{', '.join(sorted(unsupported))}")
        if disable_in_eval is not True:
            raise ValueError(
                f"UlyssesSPAttentionHF.register_with_transformers: disable_in_eval={disable_in_eval!r} is not "
                "supported: deepcompile's served engine runs evaluation forwards (model.eval() or torch.no_grad()) "
                "on the model itself, without the sequence-parallel pass, so evaluation always works as "
                "disable_in_eval=True does (each rank given whole sequences)")
        size = _positive_int("sequence_parallel_size", sequence_parallel_size, allow_none=False)
        if core_attn_implementation != SUPPORTED_ATTENTION:
            raise ValueError(
                f"UlyssesSPAttentionHF.register_with_transformers: core_attn_implementation="
                f"{core_attn_implementation!r} is not supported: deepcompile's sequence-parallel pass splits "
                "scaled_dot_product_attention calls only; use \"sdpa\" (sp_attn_implementation=\"sdpa\" in "
                "accelerate's DeepSpeedSequenceParallelConfig) and load the model with attn_implementation=\"sdpa\"")
        if max_length is not None:
            max_length = _positive_int("max_length", max_length, allow_none=False)
            if seq_length is not None and seq_length != max_length:
                raise ValueError(f"UlyssesSPAttentionHF.register_with_transformers: seq_length={seq_length} and its "
                                 f"deprecated alias max_length={max_length} disagree")
            seq_length = max_length
        seq_length = _positive_int("seq_length", seq_length, allow_none=True)
        if not isinstance(seq_length_is_variable, bool):
            raise ValueError(f"UlyssesSPAttentionHF.register_with_transformers: seq_length_is_variable must be a bool, "
                             f"got {seq_length_is_variable!r}")
        if not seq_length_is_variable:
            if seq_length is None:
                raise ValueError("UlyssesSPAttentionHF.register_with_transformers: seq_length_is_variable=False needs "
                                 "seq_length, the length of every batch's sequences")
            if seq_length % size:
                raise ValueError(f"UlyssesSPAttentionHF.register_with_transformers: seq_length={seq_length} does not "
                                 f"divide by sequence_parallel_size={size}")
        micro_batch_size = _positive_int("micro_batch_size", micro_batch_size, allow_none=True)
        config = _model_config(model_name_or_path)
        if size == 1:
            return None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None)
        if isinstance(heads, int) and heads % size:
            raise ValueError(f"UlyssesSPAttentionHF.register_with_transformers: the model's {heads} attention heads "
                             f"do not split over sequence_parallel_size={size}")
        if not dist.is_initialized():
            raise RuntimeError("UlyssesSPAttentionHF.register_with_transformers needs torch.distributed initialized "
                               "(deepspeed.init_distributed(), or accelerate's Accelerator, first)")
        groups = build_groups(size)
        mpu = SequenceParallelMPU(groups, _data_parallel_group(groups), micro_batch_size,
                                  None if seq_length_is_variable else seq_length)
        _registered = mpu
        return mpu


def _to(batch: Mapping[str, Any], device: Any) -> Dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class UlyssesSPDataLoaderAdapter:
    """Wraps a data loader whose batches hold whole sequences (``input_ids`` or ``inputs_embeds``
    ``[B, S, ...]``; ``labels``, ``position_ids``, an all-ones ``attention_mask`` optional). For
    each batch the wrapped loader gives, the ``sp_world_size`` ranks of ``sp_group`` gather each
    other's batches and then train on them one after the other, in rank order: each rank gets its
    slice (``shard_batch``: ``input_ids``, global ``position_ids``, ``shift_labels`` and ``labels``
    equal to them) of rank 0's batch, then of rank 1's, and so on, on ``device``. So
    ``len(adapter) == len(dl) * sp_world_size``."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any):
        if isinstance(sp_world_size, bool) or not isinstance(sp_world_size, int) or sp_world_size < 1:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: sp_world_size must be a positive integer, "
                             f"got {sp_world_size!r}")
        if isinstance(sp_rank, bool) or not isinstance(sp_rank, int) or not 0 <= sp_rank < sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: sp_rank {sp_rank!r} is not a rank of {sp_world_size}")
        if sp_world_size > 1:
            if not isinstance(sp_group, dist.ProcessGroup):
                raise ValueError(f"UlyssesSPDataLoaderAdapter: sp_group must be the sequence-parallel process group, "
                                 f"got {sp_group!r}")
            if dist.get_world_size(sp_group) != sp_world_size or dist.get_rank(sp_group) != sp_rank:
                raise ValueError(f"UlyssesSPDataLoaderAdapter: sp_group has {dist.get_world_size(sp_group)} ranks and "
                                 f"this process is its rank {dist.get_rank(sp_group)}, but sp_world_size="
                                 f"{sp_world_size} and sp_rank={sp_rank} were given")
        elif sp_group is not None and dist.get_world_size(sp_group) != 1:
            raise ValueError("UlyssesSPDataLoaderAdapter: sp_world_size=1 with a group of several ranks")
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = torch.device(device)
        mpu = registered()
        self.seq_length = mpu.seq_length if mpu is not None else None  # fixed length: checked per batch

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the wrapped loader (its sampler's shuffling), when it has one."""
        if hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)

    def _check(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        others = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in _BATCH_TENSORS]
        if others:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: batch keys {others} are tensors deepcompile does not know "
                             f"how to split along the sequence (supported: {', '.join(_BATCH_TENSORS)})")
        tokens = batch.get("input_ids", batch.get("inputs_embeds"))
        if self.seq_length is not None and isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 \
                and tokens.shape[1] != self.seq_length:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: a batch of sequence length {tokens.shape[1]}, but "
                             f"register_with_transformers was given seq_length={self.seq_length} with "
                             "seq_length_is_variable=False")
        return batch

    def _gather(self, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
        if self.sp_world_size == 1:
            return [batch]
        gathered: List[Any] = [None] * self.sp_world_size
        dist.all_gather_object(gathered, batch, group=self.sp_group)
        return gathered

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for batch in self.dl:
            if not isinstance(batch, Mapping):
                raise TypeError(f"UlyssesSPDataLoaderAdapter: batches must be dicts of tensors, got {type(batch)}")
            # Checked after the gather, so that every rank of the group sees the same batches and
            # refuses together instead of leaving the others waiting in the next collective.
            for whole in self._gather(_to(batch, "cpu")):
                yield _to(shard_batch(self._check(whole), self.sp_rank, self.sp_world_size), self.device)


class _ComputedByAPass:
    """ALST's tiled computations (autograd Functions that scripts call from patched model code):
    importable, refused when called, naming the config key whose graph pass does the same work
    on the unchanged model."""

    instead = ""

    def __init__(self, *args: Any, **kwargs: Any):
        raise self._refusal()

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        raise cls._refusal()

    @classmethod
    def _refusal(cls) -> Exception:
        from deepcompile.integrations.deepspeed_api._missing import refused

        return refused(f"deepspeed.runtime.sequence_parallel.ulysses_sp.{cls.__name__}",
                       f"leave the model's code unpatched and set {cls.instead} in the config: deepcompile's "
                       "compiler rewrites the model's graph to the same effect")


class TiledMLP(_ComputedByAPass):
    instead = '"compile": {"tiled_mlp": true}'


class SequenceTiledCompute(_ComputedByAPass):
    instead = '"compile": {"tiled_mlp": true} (MLPs) or "compile": {"tiled_loss": true} (the loss)'


class TiledFusedLogitsLoss(_ComputedByAPass):
    instead = '"compile": {"tiled_loss": true}'


def sequence_tiled_compute(*args: Any, **kwargs: Any) -> Any:
    raise SequenceTiledCompute._refusal()


__getattr__ = module_getattr("deepspeed.runtime.sequence_parallel.ulysses_sp")
