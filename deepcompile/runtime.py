"""Typed Python face of the C++ runtime (``deepcompile._C``).

The runtime owns everything the graph ops need between calls: the communicator, the five lanes,
the parameter registry, the reduce buckets and one executor per compiled graph. This module is a
thin layer over the pybind11 control API: it converts Python values (process groups, dtypes,
configs) and documents the contract. Graph code never calls it at run time; it only emits
the runtime's ops (``deepcompile/ops.py``), which reach the same runtime object.

Parameter layouts the runtime understands:

* ZeRO-3 (``register_z3_params``): a parameter of ``numel`` elements is flattened, padded to
  ``world * ppr`` with ``ppr = ceil(numel / world)`` and rank ``r`` holds elements
  ``[r * ppr, (r + 1) * ppr)`` as its shard. Its gradient target is this rank's ``ppr``-element
  slice of the averaged gradient (padding tail included, always zero). The shard may be stored
  in a wider dtype than the parameter is gathered in (``gather_dtypes``).
* ZeRO-1/2 (``register_z12_param``): parameters stay replicated. Each parameter group is one flat
  vector padded to ``world * partition_numel``; a parameter occupies ``[group_offset,
  group_offset + numel)`` of it and rank ``r`` owns ``[r * partition_numel, (r + 1) *
  partition_numel)``. The gradient target bound with ``bind_grad_target`` is this rank's part of the
  parameter's averaged gradient (possibly empty).

Under hybrid sharding (``zero/topology.py``) the runtime's group is the shard group: ``world``
and ``rank`` above are the shard group's, and the replica group given to ``init`` averages each
reduced partition over the ranks holding the same one in the other shard groups.
"""

from __future__ import annotations

import atexit
import dataclasses
import time
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from deepcompile import _C  # noqa: F401  (loading the library registers torch.ops.dc)

__all__ = [
    "RuntimeConfig",
    "init",
    "cleanup",
    "reset",
    "is_initialized",
    "built_with_nccl",
    "register_z3_params",
    "register_z3_param",
    "register_z12_param",
    "bind_grad_target",
    "unbind_grad_targets",
    "register_graph",
    "set_persistent",
    "start_backward",
    "enable_profiling",
    "is_profiling",
    "invalidate_gathered_param",
    "clear_all_gathered_params",
    "invalidate_all_gathered",
    "is_gathered",
    "is_persistent",
    "gathered_buffer",
    "registered_shard",
    "gather_dtype",
    "pending_reduce_tasks",
    "reduce_bucket_numel",
    "holds_grad_target",
    "was_reduced",
    "reduce_counts",
    "reduce_count",
    "world_size",
    "rank",
    "comm_bytes",
    "wire_bytes",
    "COLLECTIVE_KINDS",
    "secondary_size",
    "secondary_bytes",
    "secondary_valid",
]

STAGES = (1, 2, 3)


@dataclasses.dataclass
class RuntimeConfig:
    """Settings the C++ runtime reads at ``init``.

    ``reduce_bucket_size`` is in elements (as DeepSpeed's ``reduce_bucket_size``);
    ``free_activation_threshold`` is in bytes (DeepSpeed documents bytes but compares elements).
    """

    reduce_bucket_size: int = 500_000_000
    double_buffer: bool = True
    free_activation_threshold: int = 10 * 1024 * 1024
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False

    def __post_init__(self) -> None:
        if int(self.reduce_bucket_size) <= 0:
            raise ValueError(
                f"reduce_bucket_size must be a positive number of elements, got {self.reduce_bucket_size}"
            )
        if int(self.free_activation_threshold) < 0:
            raise ValueError(
                "free_activation_threshold must be a non-negative number of bytes, "
                f"got {self.free_activation_threshold}"
            )


def _device_type_for(group: dist.ProcessGroup, device: Optional[str]) -> str:
    if device is not None:
        device = torch.device(device).type
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        return device
    backend = dist.get_backend(group)
    return "cuda" if "nccl" in str(backend) else "cpu"


def init(
    process_group: Optional[dist.ProcessGroup] = None,
    config: Optional[RuntimeConfig] = None,
    device: Optional[str] = None,
    replica_group: Optional[dist.ProcessGroup] = None,
    secondary_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Create (or re-create) the runtime over ``process_group`` (default: the world group).

    ``replica_group`` (hybrid sharding only): the ranks that hold this rank's shards in the other
    shard groups, ``process_group`` being this rank's shard group; every reduced gradient
    partition is then averaged over it. None: no replicas, nothing extra is communicated.

    ``secondary_group`` (hpZ only): this rank's node-local group; ZeRO-3 parameters that are not
    persistent keep a secondary copy sharded over it, and gathers read that copy over it until the
    shards change (docs/design/hpz.md). None: no secondary copies.

    ``device='cuda'`` builds a private NCCL communicator whose unique id is broadcast through the
    group, and runs communication on dedicated CUDA streams. ``device='cpu'`` communicates through
    the process group itself (gloo). Calling ``init`` again first cleans up the previous runtime.
    """
    if not dist.is_initialized():
        raise RuntimeError("deepcompile.runtime.init needs torch.distributed to be initialized first")
    group = process_group if process_group is not None else dist.group.WORLD
    config = config if config is not None else RuntimeConfig()
    device_type = _device_type_for(group, device)
    device_index = torch.cuda.current_device() if device_type == "cuda" else -1
    global _DEVICE, _GENERATION
    _DEVICE = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    _GENERATION += 1
    _C.init(
        group,
        device_type,
        device_index,
        int(config.reduce_bucket_size),
        bool(config.double_buffer),
        int(config.free_activation_threshold),
        [
            bool(config.sync_before_reduce),
            bool(config.sync_after_reduce),
            bool(config.sync_before_allgather),
            bool(config.sync_after_allgather),
        ],
        replica_group,
        secondary_group,
    )


def cleanup(timeout_s: float = 60.0) -> None:
    """Drop all runtime state (registry, buckets, executors, communicator). Safe to call twice.

    Waits at most ``timeout_s`` for communication in flight; past it, or as soon as NCCL reports
    an asynchronous error, the communicators are aborted instead of waited for (a peer that is
    gone never completes its part). Never leaves a runtime behind: an error on the way is a
    warning, and ``init`` works again afterwards."""
    _C.cleanup(float(timeout_s))


def reset() -> None:
    """Drop all executors (graph state). Registry, persistent gathers and buckets survive."""
    _C.reset()


# How long the exit gives the process group's worker threads to finish with the GIL.
COLLECTIVE_THREADS_GRACE_S = 0.05


def _cleanup_at_exit() -> None:
    # The C++ runtime is never torn down by static destructors (NCCL and CUDA may already be
    # gone then); release it while the interpreter still runs.
    if _C.is_initialized():
        _C.cleanup()
    # gloo's worker threads drop their references to a finished collective's tensors after the
    # caller has moved on; where that frees a Python tensor they wait for the GIL. A worker still
    # waiting once the interpreter finalizes is ended by CPython with a forced unwind, which C++
    # turns into std::terminate (an abort at exit). This is the last atexit hook to run (registered
    # first): releasing the GIL for a moment here lets such a worker finish while it still can.
    # zero/gather_full.py holds the tensors of the usual last collective (save_model's gathers),
    # so this only covers others.
    if dist.is_available() and dist.is_initialized():
        time.sleep(COLLECTIVE_THREADS_GRACE_S)


atexit.register(_cleanup_at_exit)


def is_initialized() -> bool:
    return _C.is_initialized()


# The device of the last init (its lanes, gathered buffers and shards live there).
_DEVICE: Optional[torch.device] = None
# How many times init has run in this process: an engine remembers the runtime it registered its
# parameters with, and refuses to run on a later one (the runtime is one per process until each
# engine owns its own: issue 51).
_GENERATION = 0


def generation() -> int:
    """The number of the current runtime (each ``init`` makes a new one)."""
    return _GENERATION


def device() -> torch.device:
    """The device the runtime was initialized for."""
    if _DEVICE is None or not _C.is_initialized():
        raise RuntimeError("deepcompile.runtime.device: the runtime is not initialized")
    return _DEVICE


def built_with_nccl() -> Optional[bool]:
    """Whether the extension was compiled with its CUDA/NCCL path (``device='cuda'``); None for
    an extension built before it recorded this (rebuild to know)."""
    return getattr(_C, "built_with_nccl", None)


def world_size() -> int:
    return _C.world_size()


def rank() -> int:
    return _C.rank()


def secondary_size() -> int:
    """hpZ: the ranks of this rank's secondary group (0 without hpZ)."""
    return int(_C.secondary_size())


def secondary_bytes() -> int:
    """hpZ: device bytes held by the secondary copies (0 without hpZ)."""
    return int(_C.secondary_bytes())


# The kinds of collective the runtime counts bytes of (comm_bytes).
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "reduce", "all_reduce")
# Bytes each rank sends per payload byte under ring algorithms, for a communicator of n ranks: an
# all-gather, reduce-scatter or reduce passes n - 1 of its n chunks on; an all-reduce is a
# reduce-scatter followed by an all-gather.
_WIRE_PER_PAYLOAD = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                     "reduce": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n}


def wire_bytes(payloads: Dict[str, int], ranks: int) -> int:
    """The bytes one rank sends for ``payloads`` (collective kind -> payload bytes, the kinds of
    :func:`comm_bytes`) on a link of ``ranks`` ranks under ring algorithms, rounded once."""
    return int(round(sum(_WIRE_PER_PAYLOAD[kind](ranks) * nbytes for kind, nbytes in payloads.items())))


def comm_bytes(reset: bool = False) -> Dict[str, Dict[str, int]]:
    """Bytes of the runtime's collectives since the last reset, per communicator: ``"shard"``
    (the world without hybrid sharding), under hybrid sharding ``"replica"``, and under hpZ
    ``"secondary"`` (gathers that read the node-local secondary copies). Each holds
    ``ranks`` (the communicator's size), the payload bytes per collective kind (``all_gather``:
    the gathered output; ``reduce_scatter``: the input; ``reduce``/``all_reduce``: the buffer;
    in the dtype communicated) and ``wire``: the bytes this rank sends over that link under ring
    algorithms (docs/design/hybrid_sharding.md). ``reset``: start counting again."""
    out: Dict[str, Dict[str, int]] = {}
    for link, counted in _C.comm_bytes(reset).items():
        n = int(counted.pop("size"))
        out[str(link)] = {"ranks": n, **{k: int(v) for k, v in counted.items()}, "wire": wire_bytes(counted, n)}
    return out


def register_z3_params(
    ds_ids: Sequence[int],
    shapes: Sequence[Sequence[int]],
    shards: Sequence[torch.Tensor],
    grad_targets: Sequence[Optional[torch.Tensor]],
    persistent: Optional[Sequence[bool]] = None,
    expected_grad_dtypes: Optional[Sequence[Optional[torch.dtype]]] = None,
    gather_dtypes: Optional[Sequence[Optional[torch.dtype]]] = None,
) -> None:
    """Register ZeRO-3 parameters in one batch (one collective validates all shard sizes).

    Every rank must call this with the same ids and shapes. A shard whose numel is not
    ``ceil(numel / world)`` on any rank makes every rank raise, instead of later collectives
    hanging or corrupting memory.

    ``gather_dtypes[i]`` is the dtype parameter ``i`` is gathered in when a gather names no dtype
    (``allgather_param`` without one, prefetches without dtypes, ``set_persistent``): the module
    parameter's dtype. It may differ from the shard's storage dtype, e.g. an fp32 master shard of
    a bf16 parameter, which then gathers as bf16 with the cast fused into the gather. The
    parameter's value is the shard rounded to its gather dtype. ``None`` (the default): the
    shard's own dtype. A gather dtype must be a floating-point dtype.
    """
    n = len(ds_ids)
    persistent = list(persistent) if persistent is not None else [False] * n
    expected = list(expected_grad_dtypes) if expected_grad_dtypes is not None else [None] * n
    gather = list(gather_dtypes) if gather_dtypes is not None else [None] * n
    if not (len(shapes) == len(shards) == len(grad_targets) == len(persistent) == len(expected) == len(gather) == n):
        raise ValueError("register_z3_params: all argument lists must have the same length")
    for ds_id, dtype in zip(ds_ids, gather):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"register_z3_params: gather dtype of ds id {int(ds_id)} must be a torch.dtype, got {dtype!r}")
    targets = [t if t is not None else torch.empty(0, dtype=s.dtype, device=s.device) for t, s in zip(grad_targets, shards)]
    _C.register_z3_params(
        [int(i) for i in ds_ids],
        [[int(d) for d in s] for s in shapes],
        list(shards),
        targets,
        [bool(p) for p in persistent],
        expected,
        gather,
    )


def register_z3_param(
    ds_id: int,
    shape: Sequence[int],
    shard: torch.Tensor,
    grad_target: Optional[torch.Tensor] = None,
    persistent: bool = False,
    expected_grad_dtype: Optional[torch.dtype] = None,
    gather_dtype: Optional[torch.dtype] = None,
) -> None:
    register_z3_params([ds_id], [shape], [shard], [grad_target], [persistent], [expected_grad_dtype], [gather_dtype])


def register_z12_param(
    ds_id: int, shape: Sequence[int], param: torch.Tensor, group_offset: int, partition_numel: int
) -> None:
    """Register a replicated ZeRO-1/2 parameter at ``group_offset`` of its group's flat vector.

    It starts with no gradient target: bind one with ``bind_grad_target`` before the backward
    that reduces it.
    """
    _C.register_z12_param(int(ds_id), [int(d) for d in shape], param, int(group_offset), int(partition_numel))


def bind_grad_target(ds_id: int, target: torch.Tensor, zero: bool = True) -> None:
    """Point parameter ``ds_id``'s reduced gradient at ``target`` (zeroed unless ``zero=False``).

    The numel must equal this rank's part of the parameter (ZeRO-3: ``ppr``; ZeRO-1/2: the
    overlap of the parameter with this rank's partition).
    """
    _C.bind_grad_target(int(ds_id), target, bool(zero))


def unbind_grad_targets(ds_ids: Optional[Iterable[int]] = None) -> None:
    """Drop the runtime's references to gradient targets (all, or those of ``ds_ids``)."""
    _C.unbind_grad_targets([int(i) for i in ds_ids] if ds_ids is not None else None)


def register_graph(graph_id: int, ds_ids: Sequence[int], stage: int) -> None:
    """Create the executor of ``graph_id`` for ZeRO ``stage``, replacing any previous one."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    _C.register_graph(int(graph_id), [int(i) for i in ds_ids], int(stage))


def graph_param_ids(graph_id: int) -> List[int]:
    """The ds ids ``graph_id`` was registered with, in slot order (the slot overloads' lookup)."""
    return list(_C.graph_param_ids(int(graph_id)))


def set_persistent(ds_id: int, persistent: bool = True) -> None:
    """Keep parameter ``ds_id`` gathered across releases (selective unsharding)."""
    _C.set_persistent(int(ds_id), bool(persistent))


def set_host_shard(ds_id: int, host: Optional[torch.Tensor]) -> None:
    """Parameter offload: ``host`` (a CPU tensor of the ZeRO-3 shard's dtype and numel, pinned on
    a GPU) holds the parameter's value from now on, and every gather reads it (on a GPU: copied
    to the device on the all-gather lane, after the offload lane's pending copies), whatever the
    device shard holds, which may then be freed. ``None``: gathers read the device shard again."""
    _C.set_host_shard(int(ds_id), host)


def host_shard(ds_id: int) -> Optional[torch.Tensor]:
    """The host shard set for ``ds_id`` (ZeRO-3), or None."""
    return _C.host_shard(int(ds_id))


def lane_stream(lane: str):
    """The stream of the runtime's lane ``lane`` ("allgather", "reduce-scatter", "copy",
    "offload", "reload") as a torch stream object (``torch.cuda.Stream`` on a GPU runtime)."""
    from deepcompile import compat

    return compat.stream_from_ids(*_C.lane_stream(str(lane)))


def start_backward(update: bool) -> None:
    """Announce a backward; ``update`` is True on the last micro-step of an accumulation window."""
    _C.start_backward(bool(update))


def abort_step() -> None:
    """Abandon a step whose forward or backward raised part-way, so the next one starts clean:
    waits for the lanes, drops queued gradient reductions, release counts and non-persistent
    gathered buffers, and reopens the accumulation window (the failed window's gradients are
    dropped). Local to this rank; the engine calls it before re-raising (docs/design/runtime.md,
    "What happens on failure")."""
    _C.abort_step()


def _inject_fault(kind: str, n: int) -> None:
    """TEST-ONLY: the ``n``-th ``kind`` event from now raises inside the runtime, once (``n=0``
    disarms). ``kind``: ``"gather_alloc"`` (a gathered-buffer allocation), ``"collective"`` (a
    collective issued inside a communicator group), ``"completion_wait"`` (the wait on a group's
    collectives, process-group communicator only: where a peer's failure surfaces on gloo) or
    ``"async_error"`` (the step-time poll of the communicator reports an asynchronous error, as
    NCCL does for a lost peer: the runtime aborts its communicators and refuses further
    collectives). Counted per process; ranks that run the same step hit it at the same point."""
    _C._inject_fault(str(kind), int(n))


def enable_profiling(enabled: bool) -> None:
    _C.enable_profiling(bool(enabled))


def is_profiling() -> bool:
    return _C.is_profiling()


def invalidate_gathered_param(ds_id: int) -> None:
    _C.invalidate_gathered_param(int(ds_id))


def clear_all_gathered_params() -> None:
    _C.clear_all_gathered_params()


def invalidate_all_gathered() -> None:
    """Mark every gathered parameter stale (after an optimizer step changed the shards)."""
    _C.invalidate_all_gathered()


def is_gathered(ds_id: int) -> bool:
    return _C.is_gathered(int(ds_id))


def is_persistent(ds_id: int) -> bool:
    return _C.is_persistent(int(ds_id))


def secondary_valid(ds_id: int) -> bool:
    """hpZ: whether the parameter's secondary copy holds its current value (its next gather then
    stays inside the secondary group)."""
    return bool(_C.secondary_valid(int(ds_id)))


def gathered_buffer(ds_id: int) -> Optional[torch.Tensor]:
    """The flat padded buffer the registry holds for ``ds_id`` (None when released)."""
    return _C.gathered_buffer(int(ds_id))


def registered_shard(ds_id: int) -> torch.Tensor:
    """The tensor registered as ``ds_id``'s data (ZeRO-3: the shard gathers read from)."""
    return _C.registered_shard(int(ds_id))


def gather_dtype(ds_id: int) -> torch.dtype:
    """The dtype ``ds_id`` is gathered in when no dtype is requested."""
    return _C.gather_dtype(int(ds_id))


def pending_reduce_tasks() -> int:
    return _C.pending_reduce_tasks()


def reduce_bucket_numel() -> int:
    """Elements currently allocated in reduce buckets (all dtypes, both buffers)."""
    return _C.reduce_bucket_numel()


def was_reduced(ds_id: int) -> bool:
    """True if a gradient of ``ds_id`` was reduced in the current accumulation window."""
    return _C.was_reduced(int(ds_id))


def reduce_counts() -> Dict[int, int]:
    """Per registered parameter (ds id), how many gradients ``reduce_grad`` accepted in the current
    accumulation window: more than one means several graphs or micro-steps contributed, zero that
    none did. Counts restart when a backward opens a new window; profiling runs are not counted."""
    return {int(k): int(v) for k, v in _C.reduce_counts().items()}


def reduce_count(ds_id: int) -> int:
    """``reduce_counts()[ds_id]``, for one parameter without building the whole map."""
    return int(_C.reduce_count(int(ds_id)))


def grad_target(ds_id: int) -> Optional[torch.Tensor]:
    """The tensor parameter ``ds_id``'s reduced gradient goes to (None: not bound; a ZeRO-3
    trainable parameter gets one at its first reduction of each accumulation window)."""
    return _C.grad_target(int(ds_id))


def holds_grad_target(ds_id: int) -> bool:
    return _C.holds_grad_target(int(ds_id))
