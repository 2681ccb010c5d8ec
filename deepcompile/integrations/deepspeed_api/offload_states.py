"""DeepSpeed's ``engine.offload_states()`` / ``reload_states()`` / ``empty_partition_cache()``:
training state off the device between phases of colocated RL (OpenRLHF, open-instruct, ms-swift
move the policy's state to the host while an inference engine generates on the same GPUs).

Each state kind names device tensors of the engine; offloading copies every distinct storage
among them to host memory (pinned if asked, on a CUDA device) and then shrinks the device storage
to nothing, keeping the tensor objects: the optimizer, the module and the C++ runtime hold
references to them, and ``reload_states`` regrows the same storages and copies the bytes back.
Nothing else changes, so the next step is the step the run would have taken without the round
trip.

* ``optim_states``: the optimizer's state tensors (moments, step counts on the device);
* ``hp_params``: the fp32 master shards the optimizer steps (under ZeRO-3 also what the runtime
  gathers from);
* ``lp_params``: ZeRO-1/2, the module's parameters in the training dtype (the compiled graphs read
  them); ZeRO-3, the shards of frozen parameters (their gather sources) and every gathered copy
  the runtime keeps (freed, as ``empty_partition_cache`` does: they are gathered again at use);
* ``contiguous_grad_buffer``, ``lp_grads``: deepcompile allocates gradient partitions for each
  accumulation window and frees them at the step, so between steps there is nothing of them to
  move; asked for in the middle of a window, the offload is refused.

While offloaded, a forward, backward or step is refused (the device storages are empty).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from deepcompile import runtime
from deepcompile.integrations.deepspeed_api.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

ALL_KINDS = tuple(OffloadStateTypeEnum)


def _kinds(include: Optional[Iterable[Any]]) -> List[OffloadStateTypeEnum]:
    if include is None:
        return list(ALL_KINDS)
    out = []
    for item in include:
        try:
            out.append(OffloadStateTypeEnum(item.value if isinstance(item, OffloadStateTypeEnum) else item))
        except ValueError:
            raise ValueError(f"offload_states(include=...): unknown state {item!r}; choose from "
                             f"{', '.join(k.value for k in ALL_KINDS)}") from None
    return out


class _Moved:
    """One device storage and its bytes on the host."""

    def __init__(self, storage: torch.UntypedStorage, host: torch.Tensor):
        self.storage, self.host = storage, host


class StateOffload:
    """The offload state of one served engine."""

    def __init__(self, engine: Any, waiting_micro_steps: Callable[[], int]):
        self._engine = engine
        self._waiting = waiting_micro_steps  # micro-steps whose gradients wait for the optimizer step
        self._moved: List[_Moved] = []
        self._cleared_gathers = False

    @property
    def offloaded(self) -> bool:
        return bool(self._moved) or self._cleared_gathers

    def refuse_while_offloaded(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"DeepSpeedEngine.{what}: the training state is offloaded (offload_states()); call "
                               "reload_states() first")

    # ---- which tensors

    def _tensors(self, kind: OffloadStateTypeEnum) -> List[torch.Tensor]:
        engine = self._engine
        opt = engine.basic_optimizer
        if kind is OffloadStateTypeEnum.optim_states:
            return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
        if kind is OffloadStateTypeEnum.hp_params:
            return [p for group in opt.param_groups for p in group["params"]]
        if kind is OffloadStateTypeEnum.lp_params:
            if engine.stage == 3:
                return [sp.shard for sp in engine.sharding.params if not sp.trainable]
            return list(engine.module.parameters())
        return []  # gradient buffers: none between steps (module docstring)

    # ---- the two directions

    def offload(self, include: Optional[Sequence[Any]] = None, device: Any = OffloadDeviceEnum.cpu,
                pin_memory: bool = True, non_blocking: bool = False) -> None:
        device = OffloadDeviceEnum(device.value if isinstance(device, OffloadDeviceEnum) else device)
        if device is not OffloadDeviceEnum.cpu:
            raise ValueError(f"offload_states(device={device.value!r}): deepcompile offloads training state to the cpu "
                             "only (as DeepSpeed)")
        if self.offloaded:
            raise RuntimeError("offload_states(): the training state is already offloaded; call reload_states() first")
        waiting = self._waiting()
        if waiting:
            raise RuntimeError("offload_states(): called inside a gradient accumulation window (gradients of "
                               f"{waiting} micro-step(s) wait for the optimizer step); offload between optimizer "
                               "steps")
        kinds = _kinds(include)
        device_type = self._engine.device.type
        seen: Dict[int, torch.UntypedStorage] = {}
        for kind in kinds:
            for t in self._tensors(kind):
                storage = t.untyped_storage()
                if t.device.type != device_type or storage.nbytes() == 0:
                    continue  # already on the host (a CPU step count) or holding nothing
                seen.setdefault(storage.data_ptr(), storage)
        pin = pin_memory and device_type == "cuda"
        moved = []
        for storage in seen.values():
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(source, non_blocking=non_blocking and pin)
            moved.append(_Moved(storage, host))
        # Shrinking a storage frees its block at once. The allocator hands it out again to work on
        # any stream (the runtime's lanes included), so asynchronous copies must have read it first.
        if non_blocking and pin:
            torch.cuda.current_stream(self._engine.device).synchronize()
        for m in moved:
            m.storage.resize_(0)
        if self._engine.stage == 3 and OffloadStateTypeEnum.lp_params in kinds:
            runtime.clear_all_gathered_params()
            self._cleared_gathers = True
        self._moved = moved

    def reload(self, non_blocking: bool = False) -> None:
        for m in self._moved:
            m.storage.resize_(m.host.numel())
            target = torch.empty(0, dtype=torch.uint8, device=m.storage.device).set_(m.storage)
            target.copy_(m.host, non_blocking=non_blocking and m.host.is_pinned())
        self._moved = []
        self._cleared_gathers = False

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: free the gathered parameters ZeRO-3 keeps (they are gathered again at use)."""
        if self._engine.stage == 3:
            runtime.clear_all_gathered_params()
