"""The training engine: ``initialize`` partitions a model and optimizer, ``Engine`` runs the
DeepSpeed-style loop ``loss = engine(batch); engine.backward(loss); engine.step()``."""

from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from deepcompile import runtime
from deepcompile.config import Config
from deepcompile.eager_fallback import EAGER_GRAPH_ID, EagerGatherHooks
from deepcompile.zero.optimizer import ShardedOptimizer
from deepcompile.zero.partition import ShardedParam, partition_parameters

_BACKENDS = ("inductor", "eager")
_ACTIVE: Optional["Engine"] = None


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
        stage = config.zero_optimization.stage
        if stage != 3:
            raise ValueError(f"zero_optimization.stage {stage} is not implemented in the engine yet (supported: 3)")
        self.config = config
        self.module = model
        self.group = dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = next(model.parameters()).device
        config.check_batch_size(self.world_size)

        runtime.init(self.group, runtime.RuntimeConfig(**config.runtime_config()), device=self.device.type)
        self.params: List[ShardedParam] = partition_parameters(
            model, config.zero_optimization.stage3_param_persistence_threshold, self.group
        )
        self.optimizer = ShardedOptimizer(optimizer, self.params, self.group)
        runtime.register_z3_params(
            [sp.ds_id for sp in self.params],
            [list(sp.shape) for sp in self.params],
            [sp.shard for sp in self.params],
            [sp.grad_partition for sp in self.params],
            [sp.persistent for sp in self.params],
            [torch.float32 if sp.trainable else None for sp in self.params],
        )
        runtime.register_graph(EAGER_GRAPH_ID, [sp.ds_id for sp in self.params], stage=3)
        self.eager = EagerGatherHooks(model, self.params)

        self.gradient_accumulation_steps = config.gradient_accumulation_steps
        self.micro_steps = 0
        self.global_steps = 0
        self._compiled: Optional[nn.Module] = None
        self._graphs = None  # set by compile()
        self._backends: Dict[str, Any] = {}
        global _ACTIVE
        _ACTIVE = self

    # ---- compile ------------------------------------------------------------------------------

    def compile(self, backend: str = "inductor", **torch_compile_kwargs: Any) -> "Engine":
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self._graphs = self.backend_for(backend)
        self._compiled = torch.compile(self.module, backend=self._graphs, **torch_compile_kwargs)
        return self

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
        module = self._compiled if self._compiled is not None else self.module
        return module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        runtime.start_backward(self.is_gradient_accumulation_boundary())
        (loss / self.gradient_accumulation_steps).backward()
        # Flush what eager frames reduced, wait for every reduction and free the buckets for the
        # optimizer step. Graphs flush their own reductions; this catches the rest.
        torch.ops.dc.end_backward([], EAGER_GRAPH_ID, True)

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.config.gradient_clipping > 0:
            self.optimizer.clip_grad_norm(self.config.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad()
        # Shards changed: gathered copies (persistent ones included) are stale.
        runtime.invalidate_all_gathered()
        self.global_steps += 1

    # ---- state --------------------------------------------------------------------------------

    def eagerly_gathered_params(self) -> List[str]:
        """Names of parameters that were gathered outside compiled graphs (eager frames)."""
        return [sp.name for sp in self.params if sp.ds_id in self.eager.gathered_ids]

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The module's state dict with full, unsharded parameters, as CPU tensors.

        Identical on every rank (every rank takes part in the gathers). Tied parameters appear
        under each of their names, as in ``nn.Module.state_dict``.
        """
        full: Dict[int, torch.Tensor] = {}
        for sp in self.params:
            gathered = torch.ops.dc.allgather_param(sp.param, EAGER_GRAPH_ID, sp.ds_id)
            gathered = torch.ops.dc.wait_allgather(gathered, EAGER_GRAPH_ID, sp.ds_id)
            full[id(sp.param)] = gathered.detach().cpu().clone()
            torch.ops.dc.release_param(gathered, EAGER_GRAPH_ID, sp.ds_id, 1)
        out: Dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            out[name] = full[id(value)] if id(value) in full else value.detach().cpu().clone()
        return out

    def destroy(self) -> None:
        global _ACTIVE
        self.eager.remove()
        runtime.cleanup()
        if _ACTIVE is self:
            _ACTIVE = None


def initialize(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Union[Dict[str, Any], str, Config]
) -> Engine:
    """Partition ``model`` and ``optimizer`` over the default process group and return the engine."""
    return Engine(model, optimizer, Config.from_any(config))
