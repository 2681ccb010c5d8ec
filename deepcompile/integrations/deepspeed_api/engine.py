"""``deepspeed.DeepSpeedEngine``: DeepSpeed's engine interface over a :class:`deepcompile.Engine`.

An ``nn.Module`` holding the model as ``.module`` (as DeepSpeed's does: accelerate unwraps it
there, Trainer calls ``train()``/``eval()`` and ``zero_grad()`` on it), whose methods are those
Trainer and accelerate call. Any other attribute is the module's, as in DeepSpeed (DeepSpeed-Chat
calls ``engine.gradient_checkpointing_enable()``); one the module lacks either raises an error
naming it.

Gradient accumulation. DeepSpeed callers drive the window two ways: ``backward``/``step`` after
every micro-batch (the engine counts), or, as accelerate does, ``set_gradient_accumulation_boundary``
before each ``backward`` and ``step`` only at the boundary. deepcompile's engine counts micro-steps
in ``step`` (checkpoints and the accumulation window rely on that count), so a backward that is
not at a boundary advances the count itself, and a ``step`` right after it is the no-op it is in
DeepSpeed.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile.engine import CompiledAs, Engine
from deepcompile.integrations.deepspeed_api import run_summary
from deepcompile.integrations.deepspeed_api._missing import missing
from deepcompile.integrations.deepspeed_api.offload_states import StateOffload
from deepcompile.integrations.deepspeed_api.parameter_offload import ParameterOffload


_INFERENCE_ONLY = ("DeepSpeedEngine.{}: this engine was initialized without an optimizer (ZeRO inference): it only "
                  "evaluates; train through a deepspeed.initialize given an optimizer")


class BoundaryEngine(Engine):
    """deepcompile's engine whose accumulation boundary the caller may set (DeepSpeed's
    ``set_gradient_accumulation_boundary``); None: counted, as deepcompile does."""

    boundary_override: Optional[bool] = None

    def is_gradient_accumulation_boundary(self) -> bool:
        if self.boundary_override is not None:
            return self.boundary_override
        return super().is_gradient_accumulation_boundary()


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: host wall time from a training forward (``start``) to the
    ``step`` that ends it (``stop``), and samples per second over the optimizer steps timed, from
    the engine's ``train_batch_size``. The served engine drives it as DeepSpeed's does; callers may
    also ``start``/``stop`` it themselves. No device synchronisation: on a GPU a single interval is
    the host's, the average over many steps the real rate."""

    def __init__(self, batch_size: int):
        self.batch_size = int(batch_size)
        self.started = False
        self.start_time = 0.0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds inside start/stop intervals
        self.step_elapsed_time = 0.0  # seconds of the optimizer step being timed

    def start(self) -> None:
        self.started = True
        self.start_time = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        duration = time.perf_counter() - self.start_time
        self.micro_step_count += 1
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            self.global_step_count += 1
            if report_speed:
                logging.getLogger("deepcompile").debug(
                    "step %d: %.3f s, %.2f samples/s", self.global_step_count, self.step_elapsed_time,
                    self.avg_samples_per_sec())
            self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the optimizer steps timed so far (``-inf`` before the first)."""
        if self.global_step_count == 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size * self.global_step_count / self.total_elapsed_time


def _parameter_offload(engine: Engine) -> Optional[ParameterOffload]:
    """Built with the engine, before anything is compiled: it adds DeepSpeed's per-module and
    per-parameter attributes, which a compiled graph's guards must already see."""
    hooks = getattr(engine.sharding, "eager", None)
    if engine.stage != 3 or hooks is None:
        return None
    partitioned = [sp.param for sp in engine.sharding.params]
    return ParameterOffload(engine.module, hooks, partitioned)


class OptimizerView:
    """What ``deepspeed.initialize`` returns as the optimizer: the parameter groups (the LR a
    schedule sets), and DeepSpeed's ``overflow``. Stepping is the engine's (``engine.step()``)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._parameter_offload = _parameter_offload(engine)

    @property
    def parameter_offload(self) -> ParameterOffload:
        """DeepSpeed's ZeRO-3 hook handles (parameter_offload.py); ZeRO-1/2 have none, as in DeepSpeed."""
        if self._parameter_offload is None:
            raise missing("the DeepSpeed optimizer's parameter_offload below ZeRO stage 3 (DeepSpeed has none either)")
        return self._parameter_offload

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self._engine.basic_optimizer.param_groups

    @property
    def defaults(self) -> Dict[str, Any]:
        return self._engine.basic_optimizer.defaults

    @property
    def state(self) -> Any:
        """The optimizer state of the master shards this rank steps (DeepSpeed's ZeRO optimizers
        expose their inner optimizer's the same way); Lightning moves it to the CPU at teardown."""
        return self._engine.basic_optimizer.state

    @property
    def overflow(self) -> bool:
        return bool(getattr(self._engine.optimizer, "overflow", False))

    @property
    def cur_scale(self) -> Any:
        return getattr(self._engine.optimizer, "cur_scale", 1.0)

    loss_scale = cur_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are the engine's, cleared by its step: nothing to do (as DeepSpeed)."""

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's ``optimizer.offload_states``: the engine's (offload_states.py)."""
        self.states.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.states.reload(non_blocking)

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the optimizer deepspeed.initialize returned steps through engine.step() "
                           "(accelerate and Trainer call it for you)")

    def __getattr__(self, name: str):
        raise missing(f"the DeepSpeed optimizer's {name}")


class DeepSpeedEngine(nn.Module):
    def __init__(self, engine: BoundaryEngine, config: Dict[str, Any], inference_only: bool = False):
        super().__init__()
        self.inference_only = inference_only  # initialized without any optimizer: evaluation only
        object.__setattr__(self, "engine", engine)  # not a submodule: .module is the model
        self.module = engine.module
        self.config = config  # the dict as given (Trainer reads config["zero_optimization"]["stage"])
        self._optimizer_view = OptimizerView(engine)
        self._backward_awaits_step = False  # a boundary backward ran; its optimizer step has not
        self._states = StateOffload(engine, self._micro_steps_waiting)
        self._optimizer_view.states = self._states
        self._backend_asked: Optional[str] = None  # compile(backend=...) of the caller (accelerate)
        self._advanced_in_backward = False
        self._step_applied = False  # was_step_applied(): the last step() updated the parameters
        self.tput_timer = ThroughputTimer(engine.config.train_batch_size or 0)
        self._took_over_compile = False

    @property
    def summary_line(self) -> Optional[str]:
        """The line the engine logged at its first training forward: what runs (None before)."""
        return self.engine.summary_line

    def _first_training_forward(self) -> None:
        """Before the first training forward: take over per-layer compilation that accelerate did
        around the engine (which then says what runs, deepcompile/run_summary.py)."""
        self._took_over_compile = True
        regional = run_summary.take_over_regional_compile(self.module, self.engine)
        if regional:
            self.engine.compile(self._backend_asked or self.engine.config.compile.backend, regional=regional)

    # ---- training -----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._states.refuse_while_offloaded("forward")
        if self.module.training and torch.is_grad_enabled():
            if not self._took_over_compile:
                self._first_training_forward()
            self.tput_timer.start()
            return self.engine(*args, **kwargs)
        # Evaluation: no backward follows, so none of the engine's micro-step accounting applies;
        # the model's ZeRO hooks gather what it uses.
        if self.engine.sequence_parallel.enabled and "shift_labels" in kwargs:
            # A sequence-parallel slice (UlyssesSPDataLoaderAdapter's batches carry shift_labels):
            # the uncompiled module would attend over this rank's slice only.
            raise RuntimeError("deepcompile: an evaluation forward (eval mode or no_grad) got a sequence-parallel slice "
                               "of a batch; evaluation runs the model uncompiled, without attention's all-to-alls, so "
                               "evaluate on whole sequences (do not pass the evaluation loader through "
                               "UlyssesSPDataLoaderAdapter)")
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True,
                 **kwargs: Any) -> torch.Tensor:
        if self.inference_only:
            raise RuntimeError(_INFERENCE_ONLY.format("backward"))
        if retain_graph:
            raise missing("DeepSpeedEngine.backward(retain_graph=True)")
        if kwargs:
            raise missing(f"DeepSpeedEngine.backward arguments {sorted(kwargs)}")
        self._states.refuse_while_offloaded("backward")
        # scale_wrt_gas=False (Trainer): the caller already divided by the accumulation steps.
        self.engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        self._advanced_in_backward = not self.engine.is_gradient_accumulation_boundary()
        self._backward_awaits_step = not self._advanced_in_backward
        if self._advanced_in_backward:
            self.engine.step()  # not a boundary: only counts the micro-step
        return loss

    def step(self, lr_kwargs: Any = None) -> None:
        if self.inference_only:
            raise RuntimeError(_INFERENCE_ONLY.format("step"))
        if lr_kwargs is not None:
            raise missing("DeepSpeedEngine.step(lr_kwargs=...)")
        self._states.refuse_while_offloaded("step")
        self._step_applied = False  # as DeepSpeed: True only after an optimizer step that was not skipped
        self._backward_awaits_step = False
        if self._advanced_in_backward:
            self._advanced_in_backward = False
            self.tput_timer.stop(global_step=False)
            return
        engine = self.engine
        stepped = engine.is_gradient_accumulation_boundary()
        engine.step()
        self._step_applied = stepped and not self.optimizer.overflow
        self.tput_timer.stop(global_step=stepped)
        if stepped and engine.micro_steps % engine.gradient_accumulation_steps:
            # The caller ended the window early (accelerate at the end of an epoch): the next
            # window starts here, as in DeepSpeed.
            engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    # ---- training state off the device between phases (colocated RL: offload_states.py) ----------

    def _micro_steps_waiting(self) -> int:
        engine = self.engine
        return engine.micro_steps % engine.gradient_accumulation_steps + int(self._backward_awaits_step)

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        self._states.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self._states.reload(non_blocking)

    def empty_partition_cache(self) -> None:
        self._states.empty_partition_cache()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.engine.boundary_override = bool(is_boundary)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's step clears the gradients it owns; Trainer calls this after it."""

    def compile(self, backend: Any = None, compile_kwargs: Optional[Dict[str, Any]] = None,
                schedule: Any = None, **kwargs: Any) -> None:
        """accelerate calls this when a dynamo backend is configured (DeepSpeed's DeepCompile is
        ``"compile": {"deepcompile": true}`` plus this call)."""
        if schedule is not None:
            raise missing("DeepSpeedEngine.compile(schedule=...) (deepcompile schedules from compile.* keys)")
        name = (backend if isinstance(backend, str) and backend else self.engine.config.compile.backend).lower()
        self._backend_asked = name
        asked = CompiledAs(name, False, {**dict(compile_kwargs or {}), **kwargs})
        if self.engine.compiled_as == asked:
            # The engine compiled itself at initialize (compile.auto_compile) with these very
            # arguments: compiling again would only wrap the module a second time.
            return
        self.engine.compile(name, **asked.torch_compile_kwargs)

    def destroy(self) -> None:
        self.engine.destroy()

    # ---- queries ------------------------------------------------------------------------------

    @property
    def optimizer(self) -> OptimizerView:
        return self._optimizer_view

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_steps * self.train_batch_size()

    @property
    def skipped_steps(self) -> int:
        return int(getattr(self.engine, "skipped_steps", 0))

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    dp_world_size = world_size

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.engine.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.engine.stage

    def zero_optimization(self) -> bool:
        return self.engine.stage > 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def bfloat16_enabled(self) -> bool:
        return bool(self.engine.config.bf16.enabled)

    def fp16_enabled(self) -> bool:
        return bool(self.engine.config.fp16.enabled)

    def get_global_grad_norm(self) -> Optional[float]:
        return self.engine.get_global_grad_norm()

    def get_lr(self) -> List[float]:
        return self.engine.get_lr()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters: False between accumulation
        boundaries, after a step skipped for an fp16 overflow, and before the first step."""
        return self._step_applied

    # ---- state --------------------------------------------------------------------------------

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """The full state dict in the training dtype on rank 0 (``{}`` on the others), gathered one
        parameter at a time. Collective."""
        state = self.engine.full_state_dict()
        if exclude_frozen_parameters and state:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """DeepSpeed's stage-independent name for the above (OpenRLHF saves through it): the same
        dict at every stage, rank 0 only. Collective."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The full weights in the training dtype as one ``torch.save`` file, written by rank 0.
        As DeepSpeed: under ZeRO-3 only if ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
        is true; otherwise nothing is written and it returns False (callers then save a checkpoint)."""
        if self.engine.stage == 3 and not self.zero_gather_16bit_weights_on_model_save():
            warnings.warn(f"deepcompile: did not save the model {os.path.join(save_dir, save_filename)} because "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save is false (as DeepSpeed); "
                          "engine.engine.save_hf(dir) writes the full weights whatever the config says",
                          stacklevel=2)
            return False
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.engine.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def save_checkpoint(self, save_dir: Any, tag: Any = None, client_state: Optional[Dict[str, Any]] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """deepcompile's checkpoint (every rank writes its shards). ``exclude_frozen_parameters``
        (Trainer passes it for PEFT models) only makes DeepSpeed's files smaller; here frozen
        parameters are saved too, and loading restores them to the values they already have."""
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: Any, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None):
        if custom_load_fn is not None:
            raise missing("DeepSpeedEngine.load_checkpoint(custom_load_fn=...)")
        # load_module_strict=False (Trainer, for PEFT models) tolerates a checkpoint without the
        # frozen parameters; deepcompile's checkpoints hold every parameter, so strict or not, all load.
        if tag is None and self._no_latest_anywhere(load_dir):
            # As DeepSpeed: nothing to resume from is not an error (OpenRLHF and others call
            # load_checkpoint unconditionally at startup). A checkpoint that is there but damaged
            # or does not match still raises, from the engine.
            msg = (f"deepcompile: unable to find a 'latest' file in {os.fspath(load_dir)!r}: no checkpoint was "
                   "loaded (pass tag= to load a checkpoint that 'latest' does not name)")
            warnings.warn(msg, stacklevel=2)
            return None, None
        self._advanced_in_backward = False
        return self.engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                           load_lr_scheduler_states=load_lr_scheduler_states,
                                           load_module_only=load_module_only)

    def _no_latest_anywhere(self, load_dir: Any) -> bool:
        """True when no rank finds ``<load_dir>/latest`` (a missing or empty directory included):
        DeepSpeed's "no checkpoint". Agreed over the engine's ranks (one small collective), so that
        every rank returns or every rank goes on to load (where one rank lacking the file makes
        the engine's load raise on all)."""
        from deepcompile.checkpoint.layout import LATEST

        absent = not os.path.isfile(os.path.join(os.fspath(load_dir), LATEST))
        group = self.engine.group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            everywhere: List[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everywhere, absent, group=group)
            return all(everywhere)
        return absent

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules
        except AttributeError:
            pass
        # As DeepSpeed's engine: what it does not have itself is the wrapped module's
        # (engine.gradient_checkpointing_enable()); what it has (config, forward, save_checkpoint,
        # ...) stays its own. Dunder probes (copy, pickle) stay the engine's own misses.
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not (name.startswith("__") and name.endswith("__")):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise missing(f"DeepSpeedEngine.{name}")
