"""Gathering for code that runs eagerly: the engine without compile(), and frames Dynamo skips
(graph breaks that fall back to eager, ``torch.compiler.disable`` regions).

A forward pre-hook on every module with partitioned parameters swaps each placeholder for a
gathered tensor produced by ``_GatherForEager``; a forward hook puts the placeholders back.
While Dynamo traces, the hooks do nothing (``torch.compiler.is_compiling()``), so compiled graphs
see placeholders and the graph pass inserts the gathers. Autograd keeps a gathered tensor exactly
as long as a backward node needs it, so each eagerly gathered parameter lives until its eager
backward has used it and is freed with the last reference; no other parameter is touched. The
gradient is reduced into the parameter's partition through the runtime like any other.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Set

import torch
import torch.nn as nn

from deepcompile import compat, debug_checks, ops, runtime
from deepcompile.zero import leaf_modules
from deepcompile.zero.partition import ShardedParam, make_placeholder

# Graph id of the executor that serves eager gathers and reductions; compiled graphs get ids >= 1.
EAGER_GRAPH_ID = 0


def gather_full_copy(placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
    """The full parameter as a private tensor, outside any graph.

    A copy, because the caller may keep it (autograd until backward, a state dict for good) long
    after the runtime's buffer is released, or re-filled for persistent parameters.
    The placeholder gives only shape and dtype: one a module move left on another device
    (Lightning's teardown calls ``module.cpu()``) is replaced by one on the runtime's device.
    """
    device = runtime.device()
    if placeholder.device != device:
        placeholder = make_placeholder(placeholder.shape, placeholder.dtype, device)
    gathered = ops.allgather_param(placeholder, EAGER_GRAPH_ID, ds_id)
    gathered = ops.wait_allgather(gathered, EAGER_GRAPH_ID, ds_id)
    full = gathered.detach().clone()
    ops.release_param(gathered, EAGER_GRAPH_ID, ds_id, 1)
    return full


class _GatherForEager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, ds_id: int) -> torch.Tensor:
        ctx.ds_id = ds_id
        return gather_full_copy(placeholder, ds_id)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        debug_checks.note_reductions((ctx.ds_id,))
        ops.reduce_grad(grad.contiguous(), EAGER_GRAPH_ID, ctx.ds_id)
        return None, None


class _GatherLeafForEager(torch.autograd.Function):
    """All parameters of a leaf module, gathered together; the backward reduces a gradient for
    every trainable one (zero where this rank did not use it), in the same order on every rank,
    and tells ``on_reduced`` (if any) which it reduced."""

    @staticmethod
    def forward(ctx, ds_ids, trainable, on_reduced, *placeholders: torch.Tensor):
        ctx.ds_ids, ctx.trainable, ctx.on_reduced = ds_ids, trainable, on_reduced
        return tuple(gather_full_copy(p, ds_id) for p, ds_id in zip(placeholders, ds_ids))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        reduced = []
        for ds_id, trainable, grad in zip(ctx.ds_ids, ctx.trainable, grads):
            if trainable:
                debug_checks.note_reductions((ds_id,))
                ops.reduce_grad(grad.contiguous(), EAGER_GRAPH_ID, ds_id)
                reduced.append(ds_id)
        if ctx.on_reduced is not None and reduced:
            ctx.on_reduced(reduced)
        return (None, None, None) + (None,) * len(grads)


class EagerGatherHooks:
    """Installs the gather/restore hooks and remembers which parameters were gathered eagerly."""

    def __init__(self, module: nn.Module, params: List[ShardedParam]):
        self._by_param: Dict[int, ShardedParam] = {id(sp.param): sp for sp in params}
        self.gathered_ids: Set[int] = set()
        # Told the ds ids each leaf's backward reduced: compile.optimizer_step_in_backward steps
        # them once final (zero/backward_step.py). None: nobody needs to know.
        self.on_leaf_reductions: Optional[Callable[[Sequence[int]], None]] = None
        self._hooked: List[nn.Module] = [
            sub for sub in module.modules()
            if any(id(p) in self._by_param for p in compat.direct_parameters(sub).values() if p is not None)
        ]
        # The restore runs even when the forward raises (a checkpoint's recomputation stops that
        # way once it has what it needs). Each module would record its always-run hook id, which
        # Dynamo guards on: identical layers compiled one by one would each be captured again
        # (compiler/graph_instances.py). One shared record keeps them identical.
        self._unshare = compat.share_always_called_hooks(self._hooked)
        # While suspended (TRL's generation under a whole-model GatheredParameters, which removes
        # DeepSpeed's module hooks for its many eager forwards), the hooks leave the parameters as
        # they are: gathered into .data by that block, not gathered again per forward.
        self.suspended = False
        self._handles = []
        for sub in self._hooked:
            self._handles.append(sub.register_forward_pre_hook(self._gather))
            self._handles.append(sub.register_forward_hook(self._restore, always_call=True))

    def _gather(self, module: nn.Module, args) -> None:
        # Traced into a compiled caller, or about to be compiled as a frame of its own: the graph
        # gathers. Otherwise the forward runs eagerly, here (torch 2.11 runs a module called from
        # a frame it skipped this way: its forward is torch's own code, not compiled as a frame).
        if torch.compiler.is_compiling() or compat.will_compile_frame(module.forward) or self.suspended:
            return
        # A leaf's own parameters are gathered by its scope, with the rest of the leaf's
        # (leaf_scope): one gather, and a gradient for each in every backward. Gathered here
        # first, they would reach the scope as gathered copies it does not know.
        if leaf_modules.is_leaf(module):
            return
        self._gather_now(module)

    def _gather_now(self, module: nn.Module) -> None:
        originals = {}
        for name, p in list(compat.direct_parameters(module).items()):
            sp = self._by_param.get(id(p)) if p is not None else None
            if sp is None:
                continue
            originals[name] = p
            compat.swap_parameter(module, name, self._gathered(p, sp.ds_id))
        if originals:
            module.__dict__.setdefault("_dc_originals", []).append(originals)

    def _gathered(self, p: torch.Tensor, ds_id: int) -> torch.Tensor:
        """The full parameter; its gradient (if it trains here) is reduced in the backward."""
        self.gathered_ids.add(ds_id)
        if torch.is_grad_enabled() and p.requires_grad:
            return _GatherForEager.apply(p, ds_id)
        with torch.no_grad():
            return _GatherForEager.apply(p, ds_id)

    def _restore(self, module: nn.Module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        stack = module.__dict__.get("_dc_originals")
        if not stack:
            return
        for name, p in stack.pop().items():
            compat.swap_parameter(module, name, p)

    def leaf_scope(self, leaf: nn.Module) -> ContextManager[None]:
        """Gathers every partitioned parameter below ``leaf`` at once (leaf_modules.py)."""
        entries = [e for e in leaf_modules.leaf_parameters(leaf) if id(e[2]) in self._by_param]
        if not entries:
            return contextlib.nullcontext()
        entries.sort(key=lambda e: self._by_param[id(e[2])].ds_id)  # one order on every rank
        sps = [self._by_param[id(p)] for _, _, p in entries]
        ids = tuple(sp.ds_id for sp in sps)
        if torch.is_grad_enabled() and any(sp.param.requires_grad for sp in sps):
            fulls = _GatherLeafForEager.apply(ids, tuple(sp.param.requires_grad for sp in sps),
                                              self.on_leaf_reductions, *[sp.param for sp in sps])
        else:
            with torch.no_grad():
                fulls = _GatherLeafForEager.apply(ids, (False,) * len(ids), None, *[sp.param for sp in sps])
        self.gathered_ids.update(ids)
        full_of = {id(sp.param): full for sp, full in zip(sps, fulls)}
        owners = [(owner, name, p) for owner in leaf.modules() for name, p in compat.direct_parameters(owner).items()
                  if p is not None and id(p) in full_of]
        return leaf_modules.substituted(owners, [full_of[id(p)] for _, _, p in owners])

    def graph_runner(self, gm, param_slots: Dict[int, int]):
        """Runs a captured graph eagerly, each parameter input at ``param_slots`` (input index ->
        ds id) replaced by its gathered copy, gathered and reduced like a module's in eager code."""
        slots = sorted(param_slots.items())

        def run(*args):
            args = list(args)
            for index, ds_id in slots:
                args[index] = self._gathered(args[index], ds_id)
            return gm(*args)

        return run

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unshare()


# The hooks run for real whenever a module is called eagerly: never compiled as frames of their
# own, where torch.compiler.is_compiling() would be true and turn them into no-ops; traced
# callers still inline them.
compat.never_compile_as_frame(EagerGatherHooks._gather, recursive=False)  # must see whether Dynamo is active
compat.never_compile_as_frame(EagerGatherHooks._gather_now)
compat.never_compile_as_frame(EagerGatherHooks._restore)
