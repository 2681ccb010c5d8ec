"""The module as compiled through deepcompile: its backends, and recompiling when the plan changes.

A :class:`CompiledModule` owns the compile-side bookkeeping of one engine:

* one :class:`~deepcompile.compiler.backend.DeepCompileBackend` per inner compiler
  (``backend_for``), shared by ``engine.compile()`` and the ``"deepcompile"`` string backend;
* re-planning when the pass schedule switches plans (``recompile``): in place, graph half by
  graph half (``compiler/replan.py``), or else with the ``torch.compile`` arguments of
  ``compile()``, compiling again with a fresh backend: Dynamo keys its cache by backend, so the
  new wrapper traces afresh while nothing else is reset;
* the retired backends, whose graphs may still run (and must be cut loose at ``close``);
* which compiled module the string backend serves: the one created last and not closed;
* regional compilation (``compile(regional=...)``, ``compiler/regions.py``): the repeated blocks
  compiled in place, one by one, instead of the whole module.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from deepcompile.compiler import regions as regional_compile
from deepcompile.compiler.eager_units import EagerUnitHooks
from deepcompile.compiler.backend import INNER_COMPILERS, DeepCompileBackend
from deepcompile.compiler import replan
from deepcompile.zero.sharding import Sharding

log = logging.getLogger(__name__)

_ACTIVE: Optional["CompiledModule"] = None


class CompiledModule:
    def __init__(self, module: nn.Module, stage: int, ds_id_of: Dict[int, int], driver: Any, rank: int,
                 sharding: Optional[Sharding] = None, activations: Any = None,
                 captured_graph_passes: Sequence[Callable[[nn.Module], Any]] = ()):
        self.module = module
        # Rewrites of each graph as Dynamo captured it (DeepCompileBackend runs them first).
        self.captured_graph_passes = list(captured_graph_passes)
        self.activations = activations  # compile.free_activation / offload_activation, or None
        self._sharding = sharding  # see DeepCompileBackend
        self.stage = stage
        self.driver = driver
        self.rank = rank
        self._ds_id_of = ds_id_of
        self._backends: Dict[str, DeepCompileBackend] = {}
        self._retired: List[DeepCompileBackend] = []
        self._compile_args: Optional[Tuple[str, Dict[str, Any]]] = None
        self._regions: List[nn.Module] = []  # compiled in place (regional compilation)
        self._eager_units: Optional[EagerUnitHooks] = None  # the eager side as prefetch units (ZeRO-3)
        self._own_backend: Optional[DeepCompileBackend] = None  # the backend of compile()
        self._warned_string_backend = False
        global _ACTIVE
        _ACTIVE = self

    def compile(self, backend: str = "inductor", regional: regional_compile.RegionSpec = False,
                **torch_compile_kwargs: Any) -> nn.Module:
        """``torch.compile`` of the module with this engine's backend around ``backend``; with
        ``regional`` (True, or a list of block classes), of each block instead
        (``compiler/regions.py``), the module itself then running eagerly around them."""
        if backend not in INNER_COMPILERS:
            raise ValueError(f"backend must be one of {INNER_COMPILERS}, got {backend!r}")
        self._drop_regions()
        if regional is not False:
            self._regions = regional_compile.find_regions(self.module, regional)
            regional_compile.warn_if_layers_differ(self.module)
            if self.stage == 3:
                self._eager_units = EagerUnitHooks(self.module, self._regions, self._ds_id_of, self._chain)
        self._compile_args = (backend, dict(torch_compile_kwargs))
        return self._compile()

    def _compile(self) -> nn.Module:
        backend, kwargs = self._compile_args
        self._own_backend = self.backend_for(backend)
        if self._regions:
            regional_compile.compile_regions(self._regions, self._own_backend, kwargs)
            return self.module
        return torch.compile(self.module, backend=self._own_backend, **kwargs)

    def recompile(self) -> Optional[nn.Module]:
        """The schedule switched plans. Returns the module to run from now on, or None to keep
        running the current one.

        Usually every compiled graph half is re-planned in place (``compiler/replan.py``):
        nothing is traced again, and only halves whose graph the new plan changes are compiled
        again, when they next run. Otherwise (a half with symbolic sizes) every backend is retired
        and, if ``compile()`` was used, the module is compiled afresh; code compiled through
        ``torch.compile(module, backend="deepcompile")`` then keeps its graphs (selective
        unsharding still applies).
        """
        halves = self.driver.live_halves()
        if self._backends and halves and all(h.can_replan_in_place for h in halves):
            changed = replan.replan_in_place(halves, self.driver)
            log.debug("deepcompile: re-planned %d of %d graph halves in place", changed, len(halves))
            return None
        string_backend_used = any(b is not self._own_backend for b in self._backends.values())
        self._retired.extend(self._backends.values())  # their graphs may still run
        self._backends = {}
        compiled = self._compile() if self._compile_args is not None else None
        if string_backend_used and not self._warned_string_backend and self.rank == 0:
            self._warned_string_backend = True
            warnings.warn(
                "deepcompile: the pass schedule switched to '" + self.driver.applied.describe() + "', but code "
                "compiled with torch.compile(..., backend='deepcompile') keeps its graphs (only selective "
                "unsharding applies there); use engine.compile() for prefetch re-planning",
                stacklevel=3,
            )
        return compiled

    def _chain(self) -> Any:
        return self.driver.chain if self.driver is not None else None

    def _drop_regions(self) -> None:
        regional_compile.uncompile_regions(self._regions)
        self._regions = []
        if self._eager_units is not None:
            self._eager_units.remove()
            self._eager_units = None

    def backend_for(self, inner: str) -> DeepCompileBackend:
        """The backend of this module with ``inner`` as the final compiler (made once per plan)."""
        if inner not in self._backends:
            self._backends[inner] = DeepCompileBackend(self.stage, self._ds_id_of, self.driver, inner=inner,
                                                       sharding=self._sharding, activations=self.activations,
                                                       captured_graph_passes=self.captured_graph_passes)
        return self._backends[inner]

    @property
    def regions(self) -> List[nn.Module]:
        """The blocks compiled in place by regional compilation ([] for a whole-module compile)."""
        return list(self._regions)

    @property
    def has_backends(self) -> bool:
        """True while a backend of the current plan exists: only graphs compiled by one can be
        profiled."""
        return bool(self._backends)

    def close(self) -> None:
        """Cut every path from compiled code (which may outlive the engine) to the engine's state."""
        global _ACTIVE
        for backend in [*self._backends.values(), *self._retired]:
            backend.detach()
        self._backends, self._retired, self._own_backend = {}, [], None
        self._drop_regions()
        self._compile_args = None
        self.driver = None
        self._ds_id_of = {}
        self._sharding = None
        self.activations = None
        if _ACTIVE is self:
            _ACTIVE = None


def active_compiled_module() -> CompiledModule:
    """The compiled module of the engine created last by ``initialize`` (and not destroyed)."""
    if _ACTIVE is None:
        raise RuntimeError(
            "the 'deepcompile' backend needs an engine: call deepcompile.initialize(model, optimizer, config) "
            "before torch.compile(model, backend='deepcompile')"
        )
    return _ACTIVE


def deepcompile_backend(gm: torch.fx.GraphModule, example_inputs: List[Any],
                        options: Optional[Dict[str, Any]] = None):
    """``torch.compile(engine.module, backend="deepcompile")``: compiles for the active engine.

    ``options={"inner": "eager"}`` selects the FX executor instead of Inductor.
    """
    options = dict(options or {})
    inner = options.pop("inner", "inductor")
    if options:
        raise ValueError(f"unknown deepcompile backend options {sorted(options)}; supported: ['inner']")
    return active_compiled_module().backend_for(inner)(gm, example_inputs)
