"""DeepSpeed's ZeRO-3 module-hook handles, as RL trainers reach them around generation.

TRL (``unwrap_model_for_generation``, used by GRPO, RLOO, online DPO and by axolotl, LLaMA-Factory
and ms-swift through it) gathers the whole policy with ``GatheredParameters`` and then, so that
the many eager forwards of ``generate`` neither gather nor release anything, removes DeepSpeed's
module hooks: it reads ``engine.optimizer.parameter_offload`` (its ``module``, ``forward_hooks``,
``backward_hooks``, ``param_coordinator``), clears ``param.ds_active_sub_modules`` of every
parameter it finds through ``module.ds_external_parameters()``, removes the hook handles, and
after generation re-registers them with ``_register_deepspeed_module(module)``.

deepcompile's counterpart of those hooks is the engine's eager gather hooks
(zero/eager_fallback.py), which gather a partitioned parameter for a module that runs outside the
compiled graphs. The handle served here suspends them as a whole (``remove``) and
``_register_deepspeed_module`` resumes them; the compiled graphs are not touched (they gather what
they use, whatever the hooks do). There is no trace to invalidate: the coordinator says so.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

import torch.nn as nn


class _SuspendingHandle:
    """One handle for all of the engine's eager gather hooks: ``remove()`` suspends them."""

    def __init__(self, hooks: Any):
        self._hooks = hooks

    def remove(self) -> None:
        self._hooks.suspended = True


class _TraceCoordinator:
    """DeepSpeed's ``param_coordinator`` as TRL touches it after generation: deepcompile records
    no module trace at run time (the schedule comes from the compiled graphs), so nothing is
    invalid and invalidating does nothing."""

    def is_invalid_trace(self) -> bool:
        return True

    def _invalidate_trace(self) -> None:
        pass


def _no_external_parameters() -> Iterator[Tuple[str, nn.Parameter]]:
    return iter(())


class ParameterOffload:
    """``engine.optimizer.parameter_offload`` of a served ZeRO-3 engine."""

    def __init__(self, module: nn.Module, eager_hooks: Any, partitioned: List[nn.Parameter]):
        self.module = module
        self._hooks = eager_hooks
        self.param_coordinator = _TraceCoordinator()
        self.forward_hooks: List[_SuspendingHandle] = [_SuspendingHandle(eager_hooks)]
        self.backward_hooks: List[Any] = []  # deepcompile's backward is the compiled graphs' or autograd's
        # What DeepSpeed's hooks keep per parameter and module, read (and cleared) by TRL: no
        # module holds a parameter between hooks here, and no module uses another's parameters.
        for p in partitioned:
            if not hasattr(p, "ds_active_sub_modules"):
                p.ds_active_sub_modules = set()
        for sub in module.modules():
            if "ds_external_parameters" not in sub.__dict__:
                sub.ds_external_parameters = _no_external_parameters

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Put the hooks back (after ``remove`` of the handles): the engine's own module only."""
        if module is not self.module:
            raise ValueError("parameter_offload._register_deepspeed_module: deepcompile's hooks belong to the engine's "
                             "own module; it was given another one")
        self._hooks.suspended = False
        self.forward_hooks = [_SuspendingHandle(self._hooks)]

    @property
    def hooks_suspended(self) -> bool:
        return bool(self._hooks.suspended)
