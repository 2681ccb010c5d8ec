"""The served engine for a frozen model at ZeRO-3: TRL's reference/teacher model when the policy
trains at ZeRO-3 (DPO, KTO, GRPO, RLOO, GKD), Lightning's inference path at stage 3.

Such a model is never trained, so it needs none of deepcompile's engine (which exists to schedule
gathers, reductions and the optimizer step) and none of its per-process state: the C++ runtime,
the ``gathered_params`` registry and the served compiled module are one per process, and a
second engine built over them for the reference model took them from the policy's engine
(issue 41). This engine uses only torch.distributed: each parameter is cut into per-rank shards
(frozen_shards.py), and each module gathers the parameters it owns in an eager forward pre-hook
and releases them in its post-hook, so a rank holds its shards plus the modules running now.
A leaf module (``deepspeed.utils.set_z3_leaf_modules``) gathers everything below it at once,
so a mixture-of-experts block whose ranks call different experts still issues the same gathers.
Forward runs without autograd: nothing here is ever trained.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import compat
from deepcompile.integrations.deepspeed_api import frozen_shards, zero_init
from deepcompile.integrations.deepspeed_api.frozen_engine import FrozenEngine, _dtype
from deepcompile.zero.leaf_modules import is_leaf

_HOOKS = "_dc_frozen_gather_hooks"  # on the root module: removed when a training engine takes it
_FROZEN3 = ("this engine was initialized at ZeRO-3 without an optimizer (a frozen reference/teacher model): it only "
            "runs forward. Train through a deepspeed.initialize given an optimizer")


class FrozenZero3Engine(FrozenEngine):
    """A frozen model partitioned over the ranks, forward only. Build it with :func:`build`."""

    _refusal = _FROZEN3

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.module(*args, **kwargs)

    # The stage 0 engine's advice (the module's state_dict) does not hold: parameters are empty here.
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        raise RuntimeError(f"DeepSpeedEngine.save_checkpoint: {self._refusal} (save_16bit_model writes its weights)")

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"DeepSpeedEngine.load_checkpoint: {self._refusal} (load the weights into the model "
                           "before deepspeed.initialize)")

    def zero_optimization_stage(self) -> int:
        return 3

    def zero_optimization(self) -> bool:
        return True

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._checked.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """The full state dict on rank 0 (``{}`` elsewhere), gathered one parameter at a time on
        every rank. Collective."""
        rank0 = self.global_rank == 0
        state: Dict[str, torch.Tensor] = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if exclude_frozen_parameters and isinstance(t, nn.Parameter) and not t.requires_grad:
                continue
            if frozen_shards.shard_of(t) is not None:
                held = frozen_shards.acquire([t])
                try:
                    if rank0:
                        state[name] = t.data.detach().clone()
                finally:
                    frozen_shards.release(held)
            elif rank0:
                state[name] = t.detach()
        return state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        if not self.zero_gather_16bit_weights_on_model_save():
            warnings.warn(f"deepcompile: did not save the model {os.path.join(save_dir, save_filename)} because "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save is false (as DeepSpeed)",
                          stacklevel=2)
            return False
        return super().save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)


def _broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    # gloo does not carry every half type on every torch version; fp32 holds them exactly.
    wire = t.detach().float() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) \
        else t.detach().clone()
    dist.broadcast(wire, src=0)
    return wire


def _partition(model: nn.Module, dtype: Optional[torch.dtype], device: torch.device) -> None:
    """Every parameter becomes this rank's shard, cut evenly in ``model.parameters()`` order.
    Values: the served ``zero.Init``'s slices when the model was built there (taken as they are
    when cut over the default group, the same layout), else rank 0's. Collective."""
    world = dist.get_world_size()
    for index, p in enumerate(model.parameters()):
        target = dtype if dtype is not None and p.is_floating_point() else p.dtype
        preset = zero_init.preset_of(p)
        if preset is not None:
            if preset.group is None and preset.slice.numel() == -(-preset.numel // world):
                local = preset.slice.to(device=device, dtype=target)
            else:  # sliced over another group: gather it whole once, then cut ours
                local = frozen_shards.cut(preset.full(device), target, device)
            del p.__dict__[zero_init.DEFERRED]
            shape = preset.shape
        else:
            # On this rank's device first: NCCL carries no CPU tensor.
            full = _broadcast_from_rank0(p.data.to(device)) if world > 1 else p.data
            local = frozen_shards.cut(full.to(device), target, device)
            shape = p.shape
        frozen_shards.install(p, index, shape, local)


def _gather_hooks(model: nn.Module) -> List[Any]:
    """Per module: gather what it uses before its forward, release after (also when it raises)."""
    handles = []
    for module in model.modules():
        if is_leaf(module):
            params = list(module.parameters())  # everything below: its children's hooks only count
        else:
            params = [p for p in compat.direct_parameters(module).values() if p is not None]
        if not params:
            continue
        held_stack: List[List[torch.Tensor]] = []  # one entry per forward in flight (recursion)

        def pre(mod: nn.Module, args: Any, params: List[torch.Tensor] = params,
                held_stack: List[List[torch.Tensor]] = held_stack) -> None:
            held_stack.append(frozen_shards.acquire(params))

        def post(mod: nn.Module, args: Any, out: Any, held_stack: List[List[torch.Tensor]] = held_stack) -> None:
            if held_stack:
                frozen_shards.release(held_stack.pop())

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return handles


def build(model: nn.Module, config: Dict[str, Any]) -> FrozenZero3Engine:
    """The frozen ZeRO-3 engine for ``model``: ``config`` (stage 3, no optimizer) checked by
    deepcompile's parser, each parameter partitioned over the default process group in the
    config's dtype on this rank's device, buffers cast and placed whole. Collective."""
    from deepcompile.config import Config
    from deepcompile.zero.materialize import training_device

    unset = [name for name, p in model.named_parameters()
             if zero_init.preset_of(p) is not None and not zero_init.preset_of(p).known()]
    if unset:
        raise ValueError(f"deepspeed.initialize: parameters {unset} were built inside deepspeed.zero.Init and "
                         "never given a value (deepcompile keeps the values a module's own constructor sets, and "
                         "those written under zero.GatheredParameters(..., modifier_rank=...))")
    if any(frozen_shards.shard_of(p) is not None for p in model.parameters()):
        raise ValueError("deepspeed.initialize: this model is already held by a frozen ZeRO-3 engine")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        # Its .data are a training engine's placeholders: the values are in that engine's shards.
        raise ValueError("deepspeed.initialize: this model's parameters are partitioned by a training engine; "
                         "give the frozen engine its own copy of the model")
    checked = Config.from_any(config).resolve(dist.get_world_size(), model)
    device = training_device(model, None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = _dtype(checked)
    _partition(model, dtype, device)
    # Buffers stay whole on every rank, cast as DeepSpeed casts the module; the parameters are
    # empty by now, so this moves only the buffers.
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    model.__dict__[_HOOKS] = _gather_hooks(model)
    return FrozenZero3Engine(model, config, checked, device)


def hand_back(model: nn.Module) -> None:
    """``model`` was held by a frozen ZeRO-3 engine and a training engine takes it now: the
    gather hooks go, the shards are handed over (frozen_shards.hand_over). Nothing for another
    model."""
    for handle in model.__dict__.pop(_HOOKS, []):
        handle.remove()
    frozen_shards.hand_over(model)
