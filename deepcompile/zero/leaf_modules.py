"""Leaf modules: blocks whose parameters are gathered and reduced as one unit, whatever code runs.

A mixture-of-experts block written as a loop over the experts that received tokens calls a
different set of expert modules on each rank. Run eagerly (a graph break in the block, or
``torch.compiler.disable`` on the loop), each called expert would gather its parameters (ZeRO-3)
and reduce its gradients (all stages) while the ranks that routed no token to it do neither: the
collectives no longer pair up across ranks, and training hangs or mixes up gradients.

``set_leaf_modules(model, [MoeBlock])`` marks such blocks. A leaf's forward then always runs
eagerly (Dynamo does not trace into it), and on entry every parameter below it is gathered at once,
in ds-id order, by one autograd function; its backward reduces a gradient for every trainable
parameter of the leaf, a zero one for parameters this rank did not use. So every rank issues the
same collectives in the same order. Under ZeRO-1/2 (nothing to gather) the same function only
makes sure each parameter receives a gradient.

Mark the leaves before ``deepcompile.initialize``, which installs the gathering.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, Iterable, List, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn

from deepcompile import compat

LeafSpec = Union[Type[nn.Module], nn.Module]

# A leaf's scope: given the leaf module, a context manager that makes its parameters usable for
# the duration of one forward. Installed by the sharding at initialize.
LeafScope = Callable[[nn.Module], ContextManager[None]]


def _no_scope(module: nn.Module) -> ContextManager[None]:
    return contextlib.nullcontext()


def set_leaf_modules(model: nn.Module, leaves: Sequence[LeafSpec]) -> List[nn.Module]:
    """Mark every submodule of ``model`` that is (an instance of) one of ``leaves`` as a leaf.

    ``leaves`` holds module classes or module instances. Returns the marked modules. Raises if
    nothing matches (a misspelt class would otherwise silently leave the hang in place), if
    ``model`` was already initialized, or if a leaf lies inside another leaf.
    """
    if any(hasattr(p, "ds_id") or hasattr(p, "_dc_z12_id") for p in model.parameters()):  # ZeRO-3, ZeRO-1/2
        raise RuntimeError("deepcompile.set_leaf_modules must be called before deepcompile.initialize "
                           "(initialize installs the leaves' gathering)")
    classes = tuple(spec for spec in leaves if isinstance(spec, type))
    instances = {id(spec) for spec in leaves if isinstance(spec, nn.Module)}
    bad = [spec for spec in leaves if not isinstance(spec, nn.Module)
           and not (isinstance(spec, type) and issubclass(spec, nn.Module))]
    if bad:
        raise TypeError(f"deepcompile.set_leaf_modules takes nn.Module classes or instances, got {bad}")
    marked = [m for m in model.modules() if id(m) in instances or (classes and isinstance(m, classes))]
    if not marked:
        raise ValueError(f"deepcompile.set_leaf_modules: no submodule of the model matches {list(leaves)}")
    for leaf in marked:
        for sub in leaf.modules():
            if sub is not leaf and is_leaf(sub):
                raise ValueError(f"deepcompile.set_leaf_modules: leaf {type(sub).__name__} lies inside leaf "
                                 f"{type(leaf).__name__}; mark only the outer one")
        for outer in leaves_of(model):
            if outer is not leaf and any(m is leaf for m in outer.modules()):
                raise ValueError(f"deepcompile.set_leaf_modules: {type(leaf).__name__} lies inside leaf "
                                 f"{type(outer).__name__}; mark only the outer one")
        if is_leaf(leaf):
            continue
        leaf._dc_leaf_scope = _no_scope
        leaf.forward = _eager_leaf_forward(leaf, leaf.forward)
    return marked


def mark_classes_after_initialize(model: nn.Module, classes: Sequence[Type[nn.Module]],
                                  scope: LeafScope) -> List[Tuple[str, nn.Module]]:
    """Make every instance of ``classes`` in ``model`` a leaf now, with ``scope`` installed, on
    an initialized model (the backend's remedy for parameters that would reach eager code as
    placeholders). Skips modules that are leaves or lie inside one; returns (name, module) of
    each module marked."""
    inside_leaf = {id(m) for leaf in leaves_of(model) for m in leaf.modules()}
    marked = []
    for name, module in model.named_modules():
        if isinstance(module, tuple(classes)) and id(module) not in inside_leaf:
            module._dc_leaf_scope = scope
            module.forward = _eager_leaf_forward(module, module.forward)
            inside_leaf.update(id(m) for m in module.modules())
            marked.append((name or type(module).__name__, module))
    return marked


def is_leaf(module: nn.Module) -> bool:
    return "_dc_leaf_scope" in module.__dict__


def leaves_of(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if is_leaf(m)]


def install_scope(model: nn.Module, scope: LeafScope) -> None:
    """Called by a sharding at initialize: how its leaves make their parameters usable."""
    for leaf in leaves_of(model):
        leaf._dc_leaf_scope = scope


def _eager_leaf_forward(leaf: nn.Module, forward: Callable) -> Callable:
    # The scope is looked up at each call: initialize installs it after the leaves are marked.
    @functools.wraps(forward)
    def leaf_forward(*args, **kwargs):
        with leaf.__dict__["_dc_leaf_scope"](leaf):
            return forward(*args, **kwargs)

    # Disabled for Dynamo as a whole, so the scope always runs, eagerly, around the forward
    # (a traced forward would skip it, and a graph break inside would gather per expert again).
    return torch.compiler.disable(leaf_forward)


def leaf_parameters(leaf: nn.Module) -> List[Tuple[nn.Module, str, nn.Parameter]]:
    """(owner, name, parameter) of every parameter below ``leaf``, each once, in module order."""
    seen, out = set(), []
    for owner in leaf.modules():
        for name, p in compat.direct_parameters(owner).items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((owner, name, p))
    return out


@contextlib.contextmanager
def substituted(entries: Iterable[Tuple[nn.Module, str, nn.Parameter]], values: Sequence[torch.Tensor]):
    """Let each owner's parameter read ``value`` for the duration of the block (tied parameters:
    every owner of the same parameter gets the same value)."""
    entries = list(entries)
    for (owner, name, _), value in zip(entries, values):
        compat.swap_parameter(owner, name, value)
    try:
        yield
    finally:
        for owner, name, p in entries:
            compat.swap_parameter(owner, name, p)


class _EveryParamGetsAGradient(torch.autograd.Function):
    """Identity on a set of parameters whose backward hands each a gradient, zero where unused,
    so that every parameter's gradient hook (and its reduction) fires on every rank."""

    @staticmethod
    def forward(ctx, *params: torch.Tensor):
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


def replicated_scope(leaf: nn.Module) -> ContextManager[None]:
    """ZeRO-1/2: parameters are whole on every rank; only the gradients must all arrive."""
    entries = [e for e in leaf_parameters(leaf) if e[2].requires_grad]
    if not entries or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    owners = [(owner, name, p) for owner in leaf.modules() for name, p in compat.direct_parameters(owner).items()
              if p is not None and p.requires_grad]
    views = _EveryParamGetsAGradient.apply(*[p for _, _, p in entries])
    by_param = {id(p): v for (_, _, p), v in zip(entries, views)}
    return substituted(owners, [by_param[id(p)] for _, _, p in owners])
