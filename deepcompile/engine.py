"""The training engine: ``initialize`` partitions a model and optimizer, ``Engine`` runs the
DeepSpeed-style loop ``loss = engine(batch); engine.backward(loss); engine.step()``.

The engine only sequences a step. What it drives lives elsewhere: the stage's partitions and
optimizer (``zero/``, behind ``zero.sharding.Sharding``), compiling and recompiling the module
(``compiler/compiled_module.py``), the pass schedule (``scheduling/driver.py``) and the optional
features (offloading, the optimizer step in the backward, the debug checks, the step report): parts
whose hooks it calls at fixed points of the loop, in the order ``parts.build_parts`` lists them.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import compat, debug_checks, logging_setup, ops, optim_builder, progress, run_summary, runtime
from deepcompile.checkpoint.training_state import StepCounters, TrainingState
from deepcompile.compiler.compiled_module import CompiledModule
from deepcompile.config import Config
from deepcompile.faults import stop_watching, watch_ranks
from deepcompile.memory.budget import memory_budget
from deepcompile.offload.settings import parameter_offload_keys
from deepcompile.passes.causal_mask import CausalMaskElision, masks_are_causal
from deepcompile.passes.tiled_loss import TiledLoss
from deepcompile.passes.tiled_mlp import TiledMLP
from deepcompile.passes.tiling_choice import TilingChoice
from deepcompile.parts import Moment, Part, StepOutcome, build_parts, hooks_at
from deepcompile.precision.policy import PrecisionPolicy
from deepcompile.zero import full_values
from deepcompile.zero.eager_fallback import EAGER_GRAPH_ID
from deepcompile.scheduling.driver import ScheduleDriver
from deepcompile.sequence_parallel import SequenceParallel
from deepcompile.sequence_parallel import build_groups as build_sp_groups
from deepcompile.sequence_parallel import documents as sp_documents
from deepcompile.scheduling.schedule import PassSchedule
from deepcompile.step_report import StepReport
from deepcompile.zero.materialize import InitFn, training_device
from deepcompile.zero.sharding import Sharding
from deepcompile.zero.stage3 import Zero3Sharding
from deepcompile.zero.stage12 import Zero12Sharding
from deepcompile.zero.links import LinkReport
from deepcompile.zero.sizes import SizesReport
from deepcompile.zero.topology import ShardTopology, topology_for


def _check_implemented(config: Config) -> None:
    """Announce accepted settings whose feature does not apply (never ignore them silently); the
    rules are rows of deepcompile/config/rules.py (NOTICES)."""
    if dist.get_rank() == 0:
        for notice in config.notices():
            warnings.warn(notice, stacklevel=3)


def _make_sharding(model: nn.Module, optimizer: torch.optim.Optimizer, config: Config, precision: PrecisionPolicy,
                   topology: ShardTopology, device: torch.device, init_fn: Optional[InitFn]) -> Sharding:
    stage = config.zero_optimization.stage
    # Partitioned over the shard group; values come from the world's first rank, so that every
    # replica starts from the same ones.
    group, init_group = topology.shard_group, dist.group.WORLD
    # The stages read their gather and reduce dtypes from the engine's one precision policy.
    if stage == 3:
        # Parameter offload keeps the gather sources on the host: the stage is told, it does not
        # look at the offload settings itself.
        return Zero3Sharding(model, optimizer, config, precision, group, device=device, init_fn=init_fn,
                             masters_offloadable=bool(parameter_offload_keys(config)), init_group=init_group)
    return Zero12Sharding(model, optimizer, config, precision, group, stage, device=device, init_fn=init_fn,
                          init_group=init_group)


@dataclasses.dataclass(frozen=True)
class CompiledAs:
    """How the engine was compiled (``engine.compile``'s arguments): what the run summary says
    and what a second ``compile()`` with the same arguments is compared with."""
    backend: str
    regional: Any
    torch_compile_kwargs: Dict[str, Any]

    def describe(self) -> str:
        if self.regional is False:
            where = "whole model"
        elif self.regional is True:
            where = "per layer"
        else:
            where = "per layer: " + ", ".join(sorted(getattr(c, "__name__", str(c)) for c in self.regional))
        extra = "".join(f", {k}={v}" for k, v in sorted(self.torch_compile_kwargs.items()))
        return f"compiled ({self.backend}, {where}{extra})"


def _listed(names: List[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class Engine:
    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], config: Config,
                 lr_scheduler: Any = None, model_parameters: Any = None, init_fn: Optional[InitFn] = None,
                 device: Union[str, torch.device, None] = None, shard_group_size: Optional[int] = None,
                 compile_by_default: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("deepcompile.initialize needs torch.distributed to be initialized first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        logging_setup.show_progress(self.rank)  # rank 0's lines on stderr unless logging is configured
        # Fill "auto", complete the batch sizes and check what depends on the model (config.py).
        config = config.resolve(self.world_size, model)
        self.config = config
        # transformers' hub-kernel routing wrappers (kernels package) make Dynamo run checkpointed
        # layers eagerly, out of reach of every graph pass; where they route nothing, bypass them.
        compat.bypass_idle_kernel_routing(model)
        # Ulysses sequence parallelism (sequence_parallel/): the ranks that share each sequence.
        self.sequence_parallel = SequenceParallel(build_sp_groups(config.sequence_parallel_size),
                                                  packed=config.compile.packed_sequences)
        try:
            self.sequence_parallel.check_model(model, routed=compat.kernel_routed_modules(model))
        except BaseException:
            self.sequence_parallel.close()
            raise
        # The causal mask transformers materialises in whole-model graphs, dropped where it cannot
        # depend on the data (passes/causal_mask.py); sequence parallelism's pass drops it itself.
        # Before anything is allocated: it refuses compile.packed_sequences for non-causal models.
        self.causal_masks = self._causal_mask_pass(model, config.compile.packed_sequences)
        self.stage = config.zero_optimization.stage
        self.module = model
        self.group = dist.group.WORLD
        # Hybrid sharding (zero/topology.py): the groups parameters are partitioned over.
        self.topology = topology_for(config.zero_optimization.mics_shard_size, shard_group_size,
                                     config.zero_optimization.zero_hpz_partition_size)
        # Where parameters are materialised and trained (zero/materialize.py: training_device).
        self.device = training_device(model, device, self.group)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the runtime's streams and communicator use it
        # From here on every rank watches the others: one that raises, dies or stops answering
        # makes every rank exit naming it, instead of waiting in a collective (faults/).
        self.faults = watch_ranks(config.fault_tolerance, self.group, owner=self)
        _check_implemented(config)
        # The dtypes of parameters, masters and reductions, and fp16's loss scaling (precision/).
        self.precision = PrecisionPolicy.from_config(config)
        if self.precision.param_dtype is not None:
            optim_builder.cast_floating_parameters(model, self.precision.param_dtype)
        optimizer = optim_builder.configure_optimizer(model, optimizer, config, model_parameters)

        runtime.init(self.topology.shard_group, runtime.RuntimeConfig(**config.runtime_config()),
                     device=self.device.type, replica_group=self.topology.replica_group,
                     secondary_group=self.topology.secondary_group)
        self._runtime_generation = runtime.generation()  # checked before each use (_check_runtime_is_ours)
        # Materialises the model on self.device module by module (a meta or CPU model: ZeRO-3
        # holds its shards plus one module's parameters at a time) and partitions it.
        self.sharding: Sharding = _make_sharding(model, optimizer, config, self.precision, self.topology,
                                                   self.device, init_fn)
        # Floating-point buffers a meta model left without value (no init_fn): checked once, at
        # the first forward, together with sharding.unset_params.
        self._unset_buffers = list(self.sharding.materialized.unset_buffers)
        self._init_checked = False
        self._global_grad_norm: Optional[torch.Tensor] = None
        self.optimizer = self.sharding.optimizer
        # The torch optimizer itself (ZeRO-3 wraps it): what schedules and get_lr() act on.
        self.basic_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        self.lr_scheduler = optim_builder.configure_scheduler(self.basic_optimizer, config, lr_scheduler)
        self.loss_scaler = self.precision.make_loss_scaler()
        # As DeepSpeed reports skipped steps (Trainer and accelerate read optimizer.overflow).
        self.skipped_steps = 0
        self._report_overflow(False)
        # The device memory every planner plans against: computed once, agreed over the ranks
        # (memory/budget.py), handed to each.
        self.memory_budget = memory_budget(config.compile, self.device, self.group)
        self.step_report = StepReport(config.steps_per_print, config.wall_clock_breakdown, self.rank, self.device)

        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self.scheduler = ScheduleDriver(
            config.compile, PassSchedule.from_config(config),
            prefetch_bucket_numel=config.zero_optimization.stage3_prefetch_bucket_size,
            stage=self.stage, group=self.group, device=self.device, rank=self.rank,
            accumulation_steps=self.gradient_accumulation_steps,
            resident_ids=self.sharding.persistent_ids(), param_names=self.sharding.param_names(),
            budget=self.memory_budget,
            max_live_numel=config.zero_optimization.stage3_max_live_parameters,
            max_reuse_numel=config.zero_optimization.stage3_max_reuse_distance,
            gather_group=self.topology.shard_group,
        )
        # The optional features (offloading, the step in the backward, the debug checks, the step
        # report's line and timings), in the order their hooks run (parts.py).
        self.parts: List[Part] = build_parts(
            config, sharding=self.sharding, schedule=self.scheduler, step_report=self.step_report,
            device=self.device, group=self.group, budget=self.memory_budget,
            loss_scaling=self.precision.loss_scaling is not None)
        self._at = hooks_at(self.parts)
        # Each adds its section, if it has one; the links section names each collective's communicator.
        # The sizes section says what DeepSpeed's size keys (often Trainer-filled "auto") became.
        self.scheduler.report.contributors = list(self.parts) + [LinkReport(self.topology, self.stage),
                                                                 self._sizes_report()]
        runtime.register_graph(EAGER_GRAPH_ID, sorted(self.sharding.ds_id_of.values()), stage=self.stage)
        # compile.tiled_loss (passes/tiled_loss.py) and compile.tiled_mlp (passes/tiled_mlp.py), or
        # None; "planned" leaves each site to the memory budget (passes/tiling_choice.py).
        tiled = config.compile
        self.tiled_loss = TiledLoss(tiled.tiled_loss_chunk_tokens, TilingChoice(
            tiled.tiled_loss, self.memory_budget.bytes)) if tiled.tiled_loss else None
        self.tiled_mlp = TiledMLP(tiled.tiled_mlp_chunk_tokens, TilingChoice(
            tiled.tiled_mlp, self.memory_budget.bytes)) if tiled.tiled_mlp else None
        self.compiled_module = CompiledModule(model, self.stage, self.sharding.ds_id_of, self.scheduler, self.rank,
                                              sharding=self.sharding, activations=self.activations,
                                              captured_graph_passes=self._captured_graph_passes())
        self._compiled: Optional[nn.Module] = None  # what forward runs; None: the module itself
        self.compiled_as: Optional[CompiledAs] = None  # the arguments of the last compile(); None: eager
        self.summary_line: Optional[str] = None  # logged at the first forward (run_summary.py)
        self._first_runs = progress.FirstRuns(show=self.rank == 0)  # compiles are lazy: say when they run
        # compile.auto_compile: null follows the entry point (the served deepspeed.initialize
        # compiles, deepcompile.initialize leaves it to engine.compile()). Compiling is lazy: a
        # later engine.compile() with other arguments replaces this before anything is traced.
        auto = config.compile.auto_compile
        if compile_by_default if auto is None else auto:
            self.compile(config.compile.backend)
        full_values.register(self)  # a parameter leads to its engine (deepspeed.utils.safe_get_*)

    def _causal_mask_pass(self, model: nn.Module, packed_sequences: bool) -> Optional[CausalMaskElision]:
        """passes/causal_mask.py's pass, unless sequence parallelism's pass handles masks itself;
        with compile.packed_sequences it also turns position-derived masks into the packed
        attention op (documents published by forward(), sequence_parallel/documents.py)."""
        if self.sequence_parallel.enabled:
            return None
        causal = masks_are_causal(model)
        if packed_sequences and not causal:
            raise ValueError("compile.packed_sequences: the model's attention is not plain causal attention (an "
                             "encoder, sliding-window or chunked attention), which the packed attention op "
                             "computes; turn the key off for this model")
        if not causal:
            return None
        return CausalMaskElision(sp_documents.new_key() if packed_sequences else None)

    def _publish_documents(self, kwargs: Any) -> None:
        """compile.packed_sequences without sequence parallelism: this forward's documents, from its
        position_ids (one host read), for the packed attention op. A forward without position_ids
        traces a graph whose mask depends on shapes alone, which the pass made plain causal."""
        key = self.causal_masks.documents_key if self.causal_masks is not None else None
        positions = kwargs.get("position_ids")
        if key is None or not isinstance(positions, torch.Tensor):
            return
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        rows = next((v.shape[0] for n, v in kwargs.items() if n in ("input_ids", "inputs_embeds")
                     and isinstance(v, torch.Tensor)), positions.shape[0])
        sp_documents.publish(key, sp_documents.documents_of(positions.expand(rows, -1)))

    def _captured_graph_passes(self) -> List[Any]:
        """Rewrites of each graph as Dynamo captured it: sequence parallelism's attention pass
        (sequence_parallel/) or the causal-mask elision (passes/causal_mask.py), then
        compile.tiled_loss (passes/tiled_loss.py) and compile.tiled_mlp (passes/tiled_mlp.py)."""
        passes = [self.sequence_parallel.rewrite] if self.sequence_parallel.enabled else []
        if self.causal_masks is not None:
            passes.append(self.causal_masks.rewrite)
        for tiled in (self.tiled_loss, self.tiled_mlp):
            if tiled is not None:
                passes.append(tiled.rewrite)
        return passes

    def _sizes_report(self) -> SizesReport:
        persistent = self.sharding.persistent_ids()
        kept = set(persistent)
        numel = sum(sp.numel for sp in getattr(self.sharding, "params", []) if sp.ds_id in kept)
        return SizesReport(self.config.zero_optimization, self.stage, persistent, numel)

    def compile(self, backend: str = "inductor", regional: Any = False, **torch_compile_kwargs: Any) -> "Engine":
        """Compile the model with deepcompile's backend around ``backend`` ("inductor" or "eager").

        ``regional``: compile each repeated block on its own (True: the classes the model names
        in ``_no_split_modules``; or a list of module classes or class names), so that identical
        layers share one compiled graph (compiler/regions.py); the rest of the model runs
        eagerly. ``torch_compile_kwargs`` go to ``torch.compile``."""
        self._compiled = self.compiled_module.compile(backend, regional=regional, **torch_compile_kwargs)
        self.compiled_as = CompiledAs(backend, regional, dict(torch_compile_kwargs))
        return self

    # ---- training loop ------------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def _check_runtime_is_ours(self) -> None:
        """Refuse to run on a runtime a later ``initialize`` made: the runtime is one per process,
        so this engine's parameter ids would resolve to the other engine's parameters (issue 51)."""
        if self._runtime_generation != runtime.generation():
            raise RuntimeError(
                "deepcompile: another deepcompile.initialize in this process replaced the runtime this engine "
                "registered its parameters with, so this engine would train on the other engine's parameters. One "
                "training engine per process for now: destroy() this one and initialize it again after the other is "
                "destroyed, or run the models in separate processes")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_runtime_is_ours()
        if not self._init_checked:
            self._check_initialised()
        if self.summary_line is None:  # what runs, said once (run_summary.py)
            self.summary_line = run_summary.log_once(self)
        self.scheduler.begin_micro_step(self.global_steps,
                                        first_in_window=self.micro_steps % self.gradient_accumulation_steps == 0,
                                        can_profile=self.compiled_module.has_backends)
        moment = self._moment()
        for hook in self._at["begin_micro_step"]:
            hook(moment)
        for hook in self._at["before_forward"]:
            hook(moment, args, kwargs)
        module = self._compiled if self._compiled is not None else self.module
        if self._compiled is None:
            self._refuse_graph_options_uncompiled()
        self.sequence_parallel.check_inputs(args, kwargs)
        self._publish_documents(kwargs)
        self._watch("forward")
        self._enter(moment, "forward")
        with self._first_runs("forward", self._compiled is not None), self.sequence_parallel.guarding():
            try:
                out = module(*args, **kwargs)
            except BaseException:
                self._abort_step()
                raise
        self._exit(moment, "forward")
        if self.sequence_parallel.enabled and self.sequence_parallel.rewritten_calls == 0:
            raise RuntimeError(
                "deepcompile: sequence_parallel_size > 1, but the compiled forward called no "
                "torch.nn.functional.scaled_dot_product_attention for the pass to split, so each rank attended "
                "over its own slice only. Load the model with attn_implementation=\"sdpa\" (other attention "
                "kernels are not supported yet)")
        if self.tiled_loss is not None and not self.tiled_loss.choice.planned and self.tiled_loss.replaced == 0:
            raise RuntimeError(
                "deepcompile: compile.tiled_loss is on, but the compiled forward computed no "
                "cross_entropy over a linear layer's output (a causal LM's loss from its LM head, as transformers "
                "computes it when labels are given) for the pass to tile; pass labels to the model, or turn "
                "compile.tiled_loss off")
        if self.tiled_mlp is not None and not self.tiled_mlp.choice.planned and self.tiled_mlp.replaced == 0:
            raise RuntimeError(
                "deepcompile: compile.tiled_mlp is on, but the compiled forward computed no gated MLP "
                "(linear(act(linear(x, gate)) * linear(x, up), down) without biases, act SiLU or GELU, as Llama, "
                "Qwen2, Mistral and Gemma compute it) for the pass to tile; turn compile.tiled_mlp off for this model")
        return out

    def _refuse_graph_options_uncompiled(self) -> None:
        """Options that are passes over the compiled graph cannot hold in an uncompiled forward."""
        on = [name for name, enabled in (("sequence_parallel_size > 1", self.sequence_parallel.enabled),
                                         ("compile.tiled_loss", self.tiled_loss is not None),
                                         ("compile.tiled_mlp", self.tiled_mlp is not None)) if enabled]
        if on:
            raise RuntimeError(f"deepcompile: {' and '.join(on)} needs a compiled engine (call engine.compile() "
                               "first): it is a pass over the compiled graph, which an uncompiled forward would run "
                               "without")

    def backward(self, loss: torch.Tensor, *, tokens: Union[int, torch.Tensor, None] = None,
                 scale_wrt_gas: bool = True) -> None:
        """Backward of ``loss`` divided by gradient_accumulation_steps; with
        ``scale_wrt_gas=False`` (DeepSpeed's keyword, which Trainer passes), of ``loss`` as given,
        for a caller that divided it already (fp16's loss scale applies either way). ``tokens``:
        the number of tokens this micro-step trained on, for the tokens/s of ``steps_per_print``
        (an int or a device tensor, e.g. ``attention_mask.sum()``); default: the elements of the
        forward's ``input_ids`` argument, or of its first integer tensor argument."""
        self._check_runtime_is_ours()
        moment = self._moment()
        self.sharding.start_backward(moment.boundary)
        for hook in self._at["before_backward"]:
            hook(moment, loss, tokens)
        self._watch("backward")
        self._enter(moment, "backward")
        try:
            with self._first_runs("backward", self._compiled is not None):
                scaled = self.loss_scaler.scale_loss(loss)
                # Under sequence parallelism, a loss that is this rank's share of the global one
                # (transformers >= 5.25) is summed over the group, one combined through a
                # differentiable gather is averaged (sequence_parallel/loss.py).
                factor = self.sequence_parallel.gradient_factor(loss)
                if factor != 1:
                    scaled = scaled * factor
                if scale_wrt_gas:
                    scaled = scaled / self.gradient_accumulation_steps
                scaled.backward()
        except BaseException:
            self._abort_step()
            raise
        finally:
            self.scheduler.end_micro_step()
        # Flush what eager frames reduced, wait for every reduction and free the buckets for the
        # optimizer step. Graphs flush their own reductions; this catches the rest. A failure here
        # abandons the window as a failed backward does (the reductions it waited for are lost).
        try:
            ops.end_backward([], EAGER_GRAPH_ID, True)
        except BaseException:
            self._abort_step()
            raise
        self._exit(moment, "backward")
        for hook in self._at["after_backward"]:
            hook(moment, loss)

    def _abort_step(self) -> None:
        """A forward or backward raised: leave the runtime clean for the next step (queued
        reductions, release counts and gathered buffers of the failed step dropped) and restart
        the accumulation window, whose gradients the runtime dropped with the failed micro-step's."""
        self.micro_steps -= self.micro_steps % self.gradient_accumulation_steps
        if not runtime.is_initialized():
            return
        try:
            runtime.abort_step()
        except Exception as cleanup_error:  # the caller must see the error that failed the step
            # The runtime ran every stage of the clean-up and now refuses every later op with this
            # reason (runtime.cpp, abortStep), so nothing trains on a half-cleaned step.
            warnings.warn(f"deepcompile: cleaning up after a failed step failed too: {cleanup_error}; the runtime "
                          "refuses every later operation: destroy the engine and initialize it again", RuntimeWarning)

    def step(self) -> Optional[torch.Tensor]:
        """The optimizer step at an accumulation boundary (a no-op between). Returns the global
        gradient norm before clipping (a 0-dim tensor on the device: reading it synchronises)
        at a boundary, else None."""
        self._check_runtime_is_ours()
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return None
        moment = self._moment(boundary=True)
        for hook in self._at["at_boundary"]:
            hook(moment)
        self._watch("step")
        self._enter(moment, "step")
        for hook in self._at["before_step"]:
            hook(moment)
        scale = self.loss_scaler.loss_scale  # what this step's gradients carry (fp16), for the report
        norm = self.sharding.step(self.config.gradient_clipping, self.loss_scaler.grad_scale)
        self._global_grad_norm = norm
        for hook in self._at["after_update"]:
            hook(moment)
        # fp16: an overflow on any rank skipped the update on every rank. As DeepSpeed: the step
        # still counts in global_steps, but not in the LR schedule, which advances once per
        # applied optimizer step, at the accumulation boundary.
        overflow = self.loss_scaler.after_step(norm)
        self._report_overflow(overflow)
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._exit(moment, "step")
        self.global_steps += 1
        outcome = StepOutcome(norm, self.get_lr(), scale)
        counted = self._moment(boundary=True)
        for hook in self._at["after_step"]:
            hook(counted, outcome)
        if self.scheduler.on_optimizer_step(self.global_steps):
            recompiled = self.compiled_module.recompile()
            if recompiled is not None:
                self._compiled = recompiled
            self._first_runs.reset()
        return norm

    # ---- the parts (parts.py) -----------------------------------------------------------------

    def _moment(self, boundary: Optional[bool] = None) -> Moment:
        """Where the loop is, for the parts' hooks."""
        return Moment(self.global_steps,
                      self.is_gradient_accumulation_boundary() if boundary is None else boundary,
                      self.scheduler.mode, self._compiled)

    def _watch(self, phase: str) -> None:
        """Tell the fault watchdog what this rank does now: the phase a failure report names."""
        if self.faults is not None:
            self.faults.enter(phase, self.global_steps)

    def _enter(self, moment: Moment, phase: str) -> None:
        for hook in self._at["enter_phase"]:
            hook(moment, phase)

    def _exit(self, moment: Moment, phase: str) -> None:
        for hook in self._at["exit_phase"]:
            hook(moment, phase)

    def _feature(self, name: str) -> Any:
        """The object part ``name`` drives, or None when that feature is off."""
        return next((p.feature for p in self.parts if p.name == name), None)

    @property
    def offload(self) -> Any:
        """Optimizer-state (and parameter) offload (offload/opt_states.py), or None."""
        return self._feature("optimizer_state_offload")

    @property
    def activations(self) -> Any:
        """compile.free_activation / offload_activation (offload/activations.py), or None."""
        return self._feature("activations")

    @property
    def joint_offload(self) -> Any:
        """The joint offload plan (offload/joint.py), or None."""
        return self._feature("joint_offload")

    @property
    def _ledger(self) -> Optional[debug_checks.ReductionLedger]:
        """compile.debug_checks' reduction ledger, or None."""
        return self._feature("debug_checks")

    def _report_overflow(self, overflow: bool) -> None:
        """DeepSpeed's optimizer attributes: ``overflow`` (the last step was skipped) and, in fp16,
        ``cur_scale``/``loss_scale`` (the scale the next backward uses)."""
        self.optimizer.overflow = overflow
        if self.loss_scaler.loss_scale is not None:
            self.optimizer.cur_scale = self.optimizer.loss_scale = self.loss_scaler.loss_scale

    def get_global_grad_norm(self) -> Optional[float]:
        """The global L2 norm of the last optimizer step's gradients, before clipping (as
        ``torch.nn.utils.clip_grad_norm_`` returns it); None before the first step. Computed at
        every step, on every stage, whether or not gradient_clipping is set. fp16: the norm of the
        unscaled gradients; inf or nan at a step skipped for an overflow."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    def _check_initialised(self) -> None:
        """Before the first forward: every parameter and buffer has a value. Raised on every rank
        together (the lists are the same on every rank; the buffer check is one all-reduce)."""
        unset = list(self.sharding.unset_params)
        if unset:
            raise RuntimeError(
                f"deepcompile: parameters {_listed(unset)} have no values: the model was built on the meta device and "
                "initialize got no init_fn. Pass init_fn= to deepcompile.initialize, or load weights (write every "
                "engine.sharding.shards() piece, then call engine.sharding.sync_params_from_shards()) before the "
                "first forward")
        if self._unset_buffers:
            flags = torch.stack([compat.direct_buffers(m)[key].isnan().any() for _, m, key in self._unset_buffers])
            flags = flags.to(device=self.device, dtype=torch.int32)
            dist.all_reduce(flags, group=self.group)
            nan = [name for (name, _, _), n in zip(self._unset_buffers, flags.tolist()) if n]
            if nan:
                raise RuntimeError(
                    f"deepcompile: buffers {_listed(nan)} have no values: the model was built on the meta device and "
                    "initialize got no init_fn. Pass init_fn= (it must set buffers, e.g. transformers' "
                    "model._init_weights), or assign them before the first forward")
            self._unset_buffers = []
        self._init_checked = True

    def get_lr(self) -> List[float]:
        """The learning rate of each optimizer param group, as the next optimizer step uses it."""
        return optim_builder.learning_rates(self.basic_optimizer)

    def schedule_report(self) -> Dict[str, Any]:
        """What the profile-guided passes decided at the last schedule switch ({} before any), and
        with optimizer-state offload on, what it offloads (``optimizer_state_offload``). A dict;
        ``.to_text()`` (or ``print(report)``) renders it for reading (scheduling/report.py)."""
        return self.scheduler.report.snapshot()

    # ---- state --------------------------------------------------------------------------------

    def training_state(self) -> TrainingState:
        """What checkpoints and weight files read of this run (checkpoint/training_state.py)."""
        return TrainingState(
            module=self.module, sharding=self.sharding, optimizer=self.basic_optimizer,
            lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler, group=self.group, rank=self.rank,
            world_size=self.world_size, device=self.device,
            writes_shards=self.topology.replica_index(self.rank) == 0,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            counters=StepCounters(self.global_steps, self.micro_steps, self.skipped_steps),
            config=self.config.to_dict())

    def eagerly_gathered_params(self) -> List[str]:
        """Names of parameters that were gathered outside compiled graphs (eager frames)."""
        return self.sharding.eagerly_gathered_params()

    def full_state_dict(self, all_ranks: bool = False) -> Dict[str, torch.Tensor]:
        """The module's state dict with full parameters, as CPU tensors, on rank 0; the other
        ranks get ``{}`` (and never hold the full model) unless ``all_ranks=True``, which gives
        every rank the same dict. Collective: every rank must call it.

        Tied parameters appear under each of their names, as in ``nn.Module.state_dict``.
        """
        if self.stage == 3:  # gathered through the runtime, by parameter id
            self._check_runtime_is_ours()
        return self.sharding.full_state_dict(all_ranks)

    def save_hf(self, directory: str, max_shard_size: Union[int, str] = "5GB") -> None:
        """Write the model as ``transformers``' ``save_pretrained`` does, for
        ``AutoModelForCausalLM.from_pretrained(directory)``: safetensors files of at most
        ``max_shard_size`` (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and
        ``model.safetensors.index.json``), in the training dtype, and the config of a
        transformers model. Parameters are gathered one at a time to rank 0, which alone
        writes; an earlier export in ``directory`` is replaced only once the new one is complete.
        Collective: every rank must call it (checkpoint/hf_weights.py)."""
        from deepcompile.checkpoint.hf_weights import save_hf

        with progress.long_operation(f"writing the model to {directory}", self.rank == 0):
            save_hf(self.training_state(), directory, max_shard_size=max_shard_size)

    def save_checkpoint(self, save_dir: Any, tag: Any = None, client_state: Optional[Dict[str, Any]] = None,
                        save_latest: bool = True) -> str:
        """Save the training state as checkpoint ``<save_dir>/<tag>`` (default tag:
        ``global_step<N>``), every rank writing its own shards (torch.distributed.checkpoint), and
        with ``save_latest`` name it in ``<save_dir>/latest``. ``client_state`` (a picklable dict)
        comes back from :meth:`load_checkpoint`. Collective; only at a gradient accumulation
        boundary. Nothing becomes visible until every rank has written: a failed or cut-off save
        leaves the directory as it was. Returns the checkpoint's directory (DeepSpeed: ``True``).
        Format and behaviour: docs/design/checkpoints.md."""
        from deepcompile.checkpoint import dcp_checkpoint

        self._watch("save_checkpoint")
        with progress.long_operation(f"saving checkpoint into {save_dir}", self.rank == 0) as shown:
            path = dcp_checkpoint.save_checkpoint(self.training_state(), save_dir, tag, client_state, save_latest)
            shown["done"] = f"saved checkpoint {path}"
        if self.rank == 0:
            self._save_model_config(path)
        return path

    def _save_model_config(self, path: str) -> None:
        """A transformers model's config.json beside the checkpoint, so that ``deepcompile export``
        (cli/export.py) makes a folder ``from_pretrained`` reads without the original model at
        hand. Rank 0, after the commit: not part of what a load checks, so a failure only warns."""
        from deepcompile.checkpoint.hf_weights import write_hf_config

        try:
            write_hf_config(self.module, path)
        except Exception as e:  # noqa: BLE001  (the checkpoint itself is complete)
            warnings.warn(f"checkpoint {path} was saved, but writing the model's config.json beside it failed: "
                          f"{type(e).__name__}: {e}", stacklevel=3)

    def load_checkpoint(self, load_dir: Any, tag: Any = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Load checkpoint ``<load_dir>/<tag>`` (default: the one ``latest`` names), saved at any
        world size and ZeRO stage; returns ``(path, client_state)``. Restores the parameters, and
        unless ``load_module_only``: the optimizer state and param groups
        (``load_optimizer_states``), the LR scheduler (``load_lr_scheduler_states``), the step
        counters and, at the same world size, every rank's random number generators. A missing,
        empty, cut-off or mismatched checkpoint raises ``CheckpointError`` on every rank, before
        anything of the engine changes (DeepSpeed returns ``(None, None)`` for a missing one).
        Collective."""
        from deepcompile.checkpoint import dcp_checkpoint

        self._watch("load_checkpoint")
        with progress.long_operation(f"loading checkpoint from {load_dir}", self.rank == 0) as shown:
            path, client_state, counters = dcp_checkpoint.load_checkpoint(
                self.training_state(), load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)
            shown["done"] = f"loaded checkpoint {path}"
        if counters is not None:  # the step counters to continue from
            self.global_steps, self.micro_steps = counters.global_steps, counters.micro_steps
            self.skipped_steps = counters.skipped_steps
            self._report_overflow(False)  # the loaded loss scale, in DeepSpeed's optimizer attributes
        return path, client_state

    def destroy(self) -> None:
        # Compiled code may outlive the engine (autograd nodes, torch's compile caches): cut
        # every path from it to the engine's tensors.
        self.scheduler.close()
        for hook in self._at["close"]:
            hook()
        self.compiled_module.close()
        self._compiled = None
        full_values.unregister(self)
        self.sharding.close()
        self.sequence_parallel.close()
        if self.causal_masks is not None and self.causal_masks.documents_key is not None:
            sp_documents.withdraw(self.causal_masks.documents_key)
        if self._runtime_generation == runtime.generation():
            runtime.cleanup()  # a later engine's runtime is left to it
        stop_watching(self.faults)


def initialize(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    config: Union[Dict[str, Any], str, Config, None] = None,
    *,
    lr_scheduler: Any = None,
    model_parameters: Any = None,
    init_fn: Optional[InitFn] = None,
    device: Union[str, torch.device, None] = None,
    shard_group_size: Optional[int] = None,
) -> Engine:
    """Partition ``model`` and ``optimizer`` over the default process group and return the engine.

    ``optimizer=None`` builds the optimizer from the config's ``optimizer`` section (over
    ``model_parameters``, default: the trainable parameters); the config's ``scheduler`` section,
    or ``lr_scheduler`` (a scheduler of ``optimizer`` or a callable taking the optimizer), becomes
    ``engine.lr_scheduler``, stepped once per optimizer step. An object and a section for the same
    thing together are an error (docs/config.md).

    ``model`` may be on the ``meta`` device, on the CPU or on the training device; each rank
    materialises only what it keeps (ZeRO-3: its shards, one module's full parameters at a time),
    on ``device`` (default: the parameters' accelerator, else ``cuda:$LOCAL_RANK`` when CUDA is
    available and the process group runs NCCL, else the CPU). ``init_fn(module)`` initialises the
    parameters and buffers a module owns directly, in place (like ``reset_parameters``), with
    rank 0's random generator state on every rank (``zero/materialize.py``). Without it, rank
    0's values are used; parameters that are on ``meta`` on rank 0 have none until a loader
    writes the shards and calls ``engine.sharding.sync_params_from_shards()``.

    ``shard_group_size``: hybrid sharding, as ``zero_optimization.mics_shard_size`` (either may be
    set; both must agree): partition over groups of this many consecutive ranks, replicate across
    the groups (zero/topology.py, docs/design/hybrid_sharding.md).
    """
    if config is None:
        raise TypeError("deepcompile.initialize needs a config (a dict, a path to a JSON file or a deepcompile.Config)")
    return Engine(model, optimizer, Config.from_any(config), lr_scheduler=lr_scheduler,
                  model_parameters=model_parameters, init_fn=init_fn, device=device,
                  shard_group_size=shard_group_size)
