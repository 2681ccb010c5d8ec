"""The served engine for a frozen model at ZeRO stage 0: a reference or teacher model.

TRL's ``prepare_deepspeed`` (DPO, KTO, GRPO, RLOO, GKD) initializes the reference model with no
optimizer at stage 0 whenever training is not at ZeRO-3, and Lightning's inference path does the
same without a ``zero_optimization`` section. DeepSpeed then runs the model whole on every rank:
nothing is partitioned, so there is nothing for deepcompile's engine (which exists to partition
and schedule training) to do. This engine only holds the model on the device in the config's
dtype and forwards to it; anything that would train it is refused.

It is a ``DeepSpeedEngine`` (accelerate unwraps by that type) whose deepcompile engine is absent:
every query it answers is answered here, and a training-engine method not overridden fails with
an error that says the engine is frozen.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile.integrations.deepspeed_api._missing import missing
from deepcompile.integrations.deepspeed_api.engine import DeepSpeedEngine

_FROZEN = ("this engine was initialized at ZeRO stage 0 without an optimizer (a frozen reference/teacher model): "
           "it only runs forward. deepcompile has no stage 0 training; train through a deepspeed.initialize given "
           "an optimizer and zero_optimization.stage 1, 2 or 3")


def _dtype(config: Any) -> Optional[torch.dtype]:
    """The dtype DeepSpeed casts an unpartitioned model to: bf16 or fp16 when enabled, else
    the model's own (no cast)."""
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled:
        return torch.float16
    return None


class FrozenEngine(DeepSpeedEngine):
    """A model run whole on this rank, forward only. Build it with :func:`build`."""

    _refusal = _FROZEN  # what the refused training calls say (the ZeRO-3 frozen engine says its own)

    def __init__(self, module: nn.Module, config: Dict[str, Any], checked: Any, device: torch.device):
        nn.Module.__init__(self)  # not DeepSpeedEngine's: there is no deepcompile engine behind it
        self.inference_only = True
        self.module = module
        self.config = config  # the dict as given, less the ignored dotted keys
        self._checked = checked  # deepcompile's reading of it (batch sizes, precision)
        self._device = device

    # ---- what runs ----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"DeepSpeedEngine.backward: {self._refusal}")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"DeepSpeedEngine.step: {self._refusal}")

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        raise RuntimeError(f"DeepSpeedEngine.save_checkpoint: {self._refusal} (save the module's state_dict instead)")

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"DeepSpeedEngine.load_checkpoint: {self._refusal} (load the module's state_dict instead)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: nothing here trains."""

    def offload_states(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"DeepSpeedEngine.offload_states: {self._refusal} (no optimizer or master state to "
                           "offload; move the module itself if its parameters must leave the device)")

    def reload_states(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"DeepSpeedEngine.reload_states: {self._refusal}")

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Frozen engines run eagerly (the served initialize compiles training engines only);
        the call is accepted so that a caller compiling every engine it holds keeps working."""

    def destroy(self) -> None:
        """Nothing to release: the engine holds only the module."""

    # ---- queries ------------------------------------------------------------------------------

    @property
    def summary_line(self) -> Optional[str]:
        return None

    @property
    def optimizer(self) -> None:
        return None

    @property
    def lr_scheduler(self) -> None:
        return None

    @property
    def global_steps(self) -> int:
        return 0

    @property
    def micro_steps(self) -> int:
        return 0

    @property
    def global_samples(self) -> int:
        return 0

    @property
    def skipped_steps(self) -> int:
        return 0

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    dp_world_size = world_size

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def gradient_accumulation_steps(self) -> int:
        return self._checked.gradient_accumulation_steps or 1

    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self._checked.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> Optional[int]:
        return self._checked.train_batch_size

    def zero_optimization_stage(self) -> int:
        return 0

    def zero_optimization(self) -> bool:
        return False

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return False  # a ZeRO-3 setting: nothing is partitioned here

    def bfloat16_enabled(self) -> bool:
        return bool(self._checked.bf16.enabled)

    def fp16_enabled(self) -> bool:
        return bool(self._checked.fp16.enabled)

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def was_step_applied(self) -> bool:
        return False

    def get_global_grad_norm(self) -> None:
        return None

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """The module's state dict on rank 0 (``{}`` elsewhere), as the partitioned engines give it:
        every rank already holds all of it."""
        if self.global_rank != 0:
            return {}
        state = self.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def __getattr__(self, name: str) -> Any:
        if name == "engine":
            # Reached by the DeepSpeedEngine methods a frozen engine does not answer itself.
            raise missing(f"the training engine of a frozen DeepSpeedEngine ({type(self)._refusal})")
        return super().__getattr__(name)


def build(model: nn.Module, config: Dict[str, Any]) -> FrozenEngine:
    """The frozen engine for ``model``: ``config`` (stage 0, no optimizer) checked by deepcompile's
    parser, the model cast to its dtype and placed on this rank's device, every rank holding rank
    0's values. Collective when a process group is up (the broadcast)."""
    from deepcompile.config import Config
    from deepcompile.integrations.deepspeed_api.served_config import for_checking
    from deepcompile.zero.materialize import training_device

    from deepcompile.integrations.deepspeed_api.zero_init import preset_of

    sliced = [name for name, p in model.named_parameters() if preset_of(p) is not None]
    if sliced:
        # Each rank holds a slice of these; a stage 0 engine would need them whole on every rank.
        raise ValueError(f"deepspeed.initialize at ZeRO stage 0: parameters {sliced[:5]} were built inside "
                         "deepspeed.zero.Init (partitioned); build the model outside it, or use stage 3")
    world = dist.get_world_size() if dist.is_initialized() else 1
    checked = Config.from_any(for_checking(config)).resolve(world, model)
    device = training_device(model, None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = _dtype(checked)
    if dtype is not None:
        model.to(dtype=dtype)
    model.to(device)
    if world > 1:
        # As DeepSpeed at the unpartitioned stages: every rank runs rank 0's weights, so a head
        # initialised at random on each rank cannot make the ranks' reference scores disagree.
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
    return FrozenEngine(model, config, checked, device)
