"""The training engine: ``initialize`` partitions a model and optimizer, ``Engine`` runs the
DeepSpeed-style loop ``loss = engine(batch); engine.backward(loss); engine.step()``."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import runtime
from deepcompile.config import Config
from deepcompile.eager_fallback import EAGER_GRAPH_ID
from deepcompile.scheduling.driver import ScheduleDriver
from deepcompile.zero.stage3 import Zero3Sharding
from deepcompile.zero.stage12 import Zero12Sharding

_BACKENDS = ("inductor", "eager")
_ACTIVE: Optional["Engine"] = None


def _check_implemented(config: Config) -> None:
    """Refuse or announce accepted settings whose feature does not apply (never ignore them silently)."""
    if config.compile.free_activation:
        raise ValueError("compile.free_activation is not supported yet; set it to false")
    if config.zero_optimization.stage != 3 and config.compile.schedule and dist.get_rank() == 0:
        warnings.warn("compile.schedule holds ZeRO-3 passes only; it has no effect with stage "
                      f"{config.zero_optimization.stage}", stacklevel=3)


def active_engine() -> "Engine":
    """The engine created last by ``initialize`` (and not destroyed)."""
    if _ACTIVE is None:
        raise RuntimeError(
            "the 'deepcompile' backend needs an engine: call deepcompile.initialize(model, optimizer, config) "
            "before torch.compile(model, backend='deepcompile')"
        )
    return _ACTIVE


class Engine:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config):
        if not dist.is_initialized():
            raise RuntimeError("deepcompile.initialize needs torch.distributed to be initialized first")
        self.config = config
        self.stage = config.zero_optimization.stage
        self.module = model
        self.group = dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = next(model.parameters()).device
        config.check_batch_size(self.world_size)
        _check_implemented(config)

        runtime.init(self.group, runtime.RuntimeConfig(**config.runtime_config()), device=self.device.type)
        if self.stage == 3:
            self.sharding = Zero3Sharding(model, optimizer, config, self.group)
        else:
            self.sharding = Zero12Sharding(model, optimizer, config, self.group, self.stage)
        self.optimizer = self.sharding.optimizer
        runtime.register_graph(EAGER_GRAPH_ID, sorted(self.sharding.ds_id_of.values()), stage=self.stage)

        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self._compiled: Optional[nn.Module] = None
        self._graphs = None  # set by compile()
        self._compile_args: Optional[tuple] = None
        self._backends: Dict[str, Any] = {}
        self._retired_backends: List[Any] = []
        self._warned_string_backend = False
        self.scheduler = ScheduleDriver(self)
        global _ACTIVE
        _ACTIVE = self

    # ---- compile ------------------------------------------------------------------------------

    def compile(self, backend: str = "inductor", **torch_compile_kwargs: Any) -> "Engine":
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self._compile_args = (backend, dict(torch_compile_kwargs))
        self._graphs = self.backend_for(backend)
        self._compiled = torch.compile(self.module, backend=self._graphs, **torch_compile_kwargs)
        return self

    def _recompile(self) -> None:
        """The schedule switched plans: compile the module again with a fresh backend.

        Dynamo keys its cache by backend, so the new wrapper traces afresh while nothing else is
        reset. Code compiled through ``torch.compile(module, backend="deepcompile")`` cannot be
        re-planned this way: it keeps its graphs (selective unsharding still applies).
        """
        string_backend_used = any(b is not self._graphs for b in self._backends.values())
        self._retired_backends.extend(self._backends.values())  # their graphs may still run
        self._backends = {}
        if self._compile_args is not None:
            backend, kwargs = self._compile_args
            self._graphs = self.backend_for(backend)
            self._compiled = torch.compile(self.module, backend=self._graphs, **kwargs)
        if string_backend_used and not self._warned_string_backend and self.rank == 0:
            self._warned_string_backend = True
            warnings.warn(
                "deepcompile: the pass schedule switched to '" + self.scheduler.applied.describe() + "', but code "
                "compiled with torch.compile(..., backend='deepcompile') keeps its graphs (only selective "
                "unsharding applies there); use engine.compile() for prefetch re-planning",
                stacklevel=3,
            )

    def backend_for(self, inner: str):
        """The deepcompile backend of this engine with ``inner`` as the final compiler."""
        if inner not in self._backends:
            from deepcompile.compiler.backend import make_backend

            self._backends[inner] = make_backend(self, inner=inner)
        return self._backends[inner]

    # ---- training loop ------------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.scheduler.begin_micro_step(self.micro_steps % self.gradient_accumulation_steps == 0)
        module = self._compiled if self._compiled is not None else self.module
        return module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.sharding.before_backward(boundary)
        runtime.start_backward(boundary)
        try:
            (loss / self.gradient_accumulation_steps).backward()
        finally:
            self.scheduler.end_micro_step()
        # Flush what eager frames reduced, wait for every reduction and free the buckets for the
        # optimizer step. Graphs flush their own reductions; this catches the rest.
        torch.ops.dc.end_backward([], EAGER_GRAPH_ID, True)

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self.sharding.step(self.config.gradient_clipping)
        self.global_steps += 1
        if self.scheduler.on_optimizer_step():
            self._recompile()

    def schedule_report(self) -> Dict[str, Any]:
        """What the profile-guided passes decided at the last schedule switch ({} before any)."""
        return self.scheduler.report.as_dict()

    # ---- state --------------------------------------------------------------------------------

    def eagerly_gathered_params(self) -> List[str]:
        """Names of parameters that were gathered outside compiled graphs (eager frames)."""
        return self.sharding.eagerly_gathered_params()

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The module's state dict with full parameters, as CPU tensors, identical on every rank.

        Tied parameters appear under each of their names, as in ``nn.Module.state_dict``.
        """
        return self.sharding.full_state_dict()

    def destroy(self) -> None:
        global _ACTIVE
        from deepcompile.compiler.backend import detach_backend

        # Compiled code may outlive the engine (autograd nodes, torch's compile caches): cut
        # every path from it to the engine's tensors.
        self.scheduler.close()
        for backend in [*self._backends.values(), *self._retired_backends]:
            detach_backend(backend)
        self._backends, self._retired_backends = {}, []
        self._compiled = self._graphs = None
        self.sharding.close()
        runtime.cleanup()
        if _ACTIVE is self:
            _ACTIVE = None


def initialize(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Union[Dict[str, Any], str, Config]
) -> Engine:
    """Partition ``model`` and ``optimizer`` over the default process group and return the engine."""
    return Engine(model, optimizer, Config.from_any(config))
