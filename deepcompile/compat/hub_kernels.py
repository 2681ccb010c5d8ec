"""Hugging Face's ``kernels`` package, as transformers (>= 5.25 requires it) applies it to models.

``kernels.use_kernelized_func`` wraps the ``forward`` of modules such as ``LlamaAttention``: each
call stores a routing table in a context variable (under ``torch.compile`` an attribute of a
global object) and restores it on return, so that calls of a hub function (``apply_rotary_pos_emb``)
reach the model's own kernel wrapper. Inside an activation-checkpointed region Dynamo refuses that
mutation ("HOP: Unsafe side effect") and runs the whole checkpointed layer eagerly: its graph
passes (the causal-mask elision, Ulysses' attention rewrite) never see it.

Until ``kernels.kernelize`` selects a hub kernel for a wrapper, the routing sends every call to the
plain function, which the unwrapped forward calls anyway. ``bypass_idle_kernel_routing`` gives such
modules their unwrapped forward (an instance attribute: the class and other models are untouched);
modules whose wrappers were kernelized keep the routing (their kernels are the user's choice).
Relies on the wrapper being ``functools.wraps`` of the original forward, defined in ``kernels``,
and on the per-instance wrappers living in ``module._kernel_funcs``.
"""

from __future__ import annotations

import types
from typing import List

import torch.nn as nn


def _is_kernel_routing(forward) -> bool:
    """Whether ``forward`` is the wrapper ``kernels.use_kernelized_func`` puts on a class."""
    module_name = getattr(forward, "__globals__", {}).get("__name__", "")
    return (module_name.split(".")[0] == "kernels" and hasattr(forward, "__wrapped__")
            and getattr(getattr(forward, "__code__", None), "co_name", "") == "new_forward")


def _routes_to_a_kernel(module: nn.Module) -> bool:
    """Whether ``kernelize`` gave any of the module's private wrappers a hub kernel's forward
    (it sets the wrapper's ``forward`` instance attribute)."""
    wrappers = module.__dict__.get("_kernel_funcs") or {}
    return any("forward" in getattr(w, "__dict__", {}) for w in wrappers.values())


def bypass_idle_kernel_routing(model: nn.Module) -> List[str]:
    """Give every submodule of ``model`` whose class forward is ``kernels``' routing wrapper, and
    whose wrappers select no hub kernel, its original forward. Returns the modules' names."""
    bypassed = []
    for name, module in model.named_modules():
        forward = type(module).forward
        if not _is_kernel_routing(forward) or "forward" in module.__dict__ or _routes_to_a_kernel(module):
            continue
        module.forward = types.MethodType(forward.__wrapped__, module)
        bypassed.append(name)
    return bypassed


def kernel_routed_modules(model: nn.Module) -> List[str]:
    """The submodules that still route through ``kernels``' wrapper (kernelized ones, or all of them
    before ``bypass_idle_kernel_routing``): their checkpointed calls run outside Dynamo's graphs."""
    return [name for name, module in model.named_modules()
            if _is_kernel_routing(type(module).forward) and "forward" not in module.__dict__]
