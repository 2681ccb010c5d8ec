"""Every custom operator of the package: where its schema and fake kernel are, a typed wrapper
for eager callers, and its overloads as named constants for graph passes.

Two namespaces:

* ``dc`` (C++, ``csrc/ops.cpp``): the runtime's gather, release, reduce and free ops. Schemas and
  kernels (CPU, CUDA and Meta, the fake kernel) register when the extension loads, which this
  module does. Each op but ``free_tensors`` has two overloads: ``default`` names the graph and the
  parameter by constant ids, ``slot`` reads them from the graph instance input
  (``passes/slot_ops.py``).
* ``dcact`` (Python, defined here): activation offload. Schemas and fake kernels live here; the
  CPU/CUDA kernels act on the run-time offload state and are handed in by
  ``offload/activation_ops.py`` (:func:`register_activation_kernels`), which documents the ops.
* ``dcloss`` (Python, defined here): the tiled loss (cross-entropy over a linear layer's output,
  computed a chunk of tokens at a time). Schemas, fake kernels and the autograd formula live here;
  the kernels are handed in by ``passes/tiled_loss_kernels.py`` (:func:`register_tiled_loss_kernels`).
* ``dcmlp`` (Python, defined here): the tiled MLP (a gated MLP computed a chunk of tokens at a
  time). Schemas, fake kernels and the autograd formula live here; the kernels are handed in by
  ``passes/tiled_mlp_kernels.py`` (:func:`register_tiled_mlp_kernels`).
* ``dcsp`` (Python, defined here): sequence parallelism's all-to-all, and for packed sequences the
  forward's documents and attention kept inside them. Schemas, fake kernels and autograd formulas
  live here; the kernels are handed in by ``sequence_parallel/all_to_all.py``
  (:func:`register_sequence_parallel_kernel`), ``sequence_parallel/documents.py`` and
  ``sequence_parallel/packed_attention.py``.

Eager code calls the wrappers; graph passes insert the constants as ``call_function`` targets and
compare node targets against them. No other module reaches ``torch.ops.dc`` or
``torch.ops.dcact`` (tests/runtime/test_ops_registry.py), so renaming or adding an op is one edit here
plus its kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from deepcompile import _C  # noqa: F401  (loading the extension registers the dc namespace)

RUNTIME_NAMESPACE = "dc"
ACTIVATION_NAMESPACE = "dcact"
SEQUENCE_PARALLEL_NAMESPACE = "dcsp"
TILED_LOSS_NAMESPACE = "dcloss"
TILED_MLP_NAMESPACE = "dcmlp"
NAMESPACES = (RUNTIME_NAMESPACE, ACTIVATION_NAMESPACE, SEQUENCE_PARALLEL_NAMESPACE, TILED_LOSS_NAMESPACE,
              TILED_MLP_NAMESPACE)

_dc = getattr(torch.ops, RUNTIME_NAMESPACE)

# ---- dc: the runtime's ops (csrc/ops.cpp) --------------------------------------------------------

ALLGATHER_PARAM = _dc.allgather_param.default
ALLGATHER_PARAM_SLOT = _dc.allgather_param.slot
PREFETCH_PARAMS_FUSED = _dc.prefetch_params_fused.default
PREFETCH_PARAMS_FUSED_SLOT = _dc.prefetch_params_fused.slot
WAIT_ALLGATHER = _dc.wait_allgather.default
WAIT_ALLGATHER_SLOT = _dc.wait_allgather.slot
RELEASE_PARAM = _dc.release_param.default
RELEASE_PARAM_SLOT = _dc.release_param.slot
REDUCE_GRAD = _dc.reduce_grad.default
REDUCE_GRAD_SLOT = _dc.reduce_grad.slot
END_BACKWARD = _dc.end_backward.default
END_BACKWARD_SLOT = _dc.end_backward.slot
FREE_TENSORS = _dc.free_tensors.default


def allgather_param(param: torch.Tensor, graph_id: int, ds_id: int,
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Start gathering ``ds_id`` for ``graph_id``'s executor (None: in its registered gather
    dtype); the result is valid after :func:`wait_allgather`."""
    return ALLGATHER_PARAM(param, graph_id, ds_id, dtype=dtype)


def prefetch_params_fused(graph_id: int, params: Sequence[torch.Tensor], ds_ids: Sequence[int],
                          dtypes: Optional[Sequence[torch.dtype]] = None) -> None:
    """Gather ``ds_ids`` ahead of their use, as one group (``params`` may be empty: the runtime
    finds parameters by id)."""
    PREFETCH_PARAMS_FUSED(graph_id, list(params), list(ds_ids), dtypes=None if dtypes is None else list(dtypes))


def wait_allgather(gathered: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    """The compute stream waits for ``ds_id``'s gather; returns the gathered parameter."""
    return WAIT_ALLGATHER(gathered, graph_id, ds_id)


def release_param(x: torch.Tensor, graph_id: int, ds_id: int, n_users: int) -> torch.Tensor:
    """One of ``n_users`` is done with the gathered ``ds_id`` (the last frees it unless it is
    persistent); returns ``x``, an alias that orders later readers after the release."""
    return RELEASE_PARAM(x, graph_id, ds_id, n_users)


def reduce_grad(grad: torch.Tensor, graph_id: int, ds_id: int) -> torch.Tensor:
    """Queue ``grad`` for reduction into ``ds_id``'s gradient target."""
    return REDUCE_GRAD(grad, graph_id, ds_id)


def end_backward(deps: Sequence[torch.Tensor], graph_id: int, release_reduce_buckets: bool) -> None:
    """Flush ``graph_id``'s queued reductions (after ``deps``); with ``release_reduce_buckets``,
    wait for every reduction and free the buckets."""
    END_BACKWARD(list(deps), graph_id, release_reduce_buckets)


def free_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Free the storage of each tensor at least the runtime's free-activation threshold."""
    FREE_TENSORS(list(tensors))


# ---- dcact: activation offload (kernels: offload/activation_ops.py) ----------------------------

_ACTIVATION_LIB = torch.library.Library(ACTIVATION_NAMESPACE, "DEF")
_ACTIVATION_SCHEMAS = {
    "offload_activation": "offload_activation(Tensor(a!) x, Tensor[] after, int key) -> ()",
    "reload_activation": "reload_activation(Tensor(a!) x, int key) -> ()",
    "wait_reload": "wait_reload(Tensor(a) x, int key) -> Tensor(a)",
    "free_after": "free_after(Tensor(a!)[] xs, Tensor[] after) -> ()",
}
for _schema in _ACTIVATION_SCHEMAS.values():
    _ACTIVATION_LIB.define(_schema)


def _fake_nothing(*args: Any) -> None:
    return None


def _fake_alias(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.view(x.shape)


# Fake (Meta) kernels: shapes only, no run-time state (a traced call must not move anything). The
# first two return nothing, so no fake tensor claims a device the real result is not on.
_ACTIVATION_FAKES: Dict[str, Callable] = {
    "offload_activation": _fake_nothing,
    "reload_activation": _fake_nothing,
    "wait_reload": _fake_alias,
    "free_after": _fake_nothing,
}
for _name, _fake in _ACTIVATION_FAKES.items():
    _ACTIVATION_LIB.impl(_name, _fake, "Meta")

_dcact = getattr(torch.ops, ACTIVATION_NAMESPACE)
OFFLOAD_ACTIVATION = _dcact.offload_activation.default
RELOAD_ACTIVATION = _dcact.reload_activation.default
WAIT_RELOAD = _dcact.wait_reload.default
FREE_AFTER = _dcact.free_after.default


def register_activation_kernels(kernels: Dict[str, Callable]) -> None:
    """The CPU and CUDA kernels of the ``dcact`` ops, by op name (every op, once): they read the
    offload state, which lives in ``offload/activation_ops.py``."""
    if set(kernels) != set(_ACTIVATION_SCHEMAS):
        raise ValueError(f"kernels for {sorted(kernels)}, expected {sorted(_ACTIVATION_SCHEMAS)}")
    for dispatch_key in ("CPU", "CUDA"):
        for name, kernel in kernels.items():
            _ACTIVATION_LIB.impl(name, kernel, dispatch_key)


def offload_activation(x: torch.Tensor, after: Sequence[torch.Tensor], key: int) -> None:
    OFFLOAD_ACTIVATION(x, list(after), key)


def reload_activation(x: torch.Tensor, key: int) -> None:
    RELOAD_ACTIVATION(x, key)


def wait_reload(x: torch.Tensor, key: int) -> torch.Tensor:
    return WAIT_RELOAD(x, key)


def free_after(xs: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> None:
    FREE_AFTER(list(xs), list(after))


# ---- dcsp: sequence parallelism (kernel: sequence_parallel/all_to_all.py) -----------------------

_SEQUENCE_PARALLEL_LIB = torch.library.Library(SEQUENCE_PARALLEL_NAMESPACE, "DEF")
# ``x`` is split into ``ranks`` equal chunks along ``scatter_dim``; chunk j goes to rank j of the
# group, and the chunks received are concatenated along ``gather_dim`` in rank order. ``group`` is
# a key of sequence_parallel/all_to_all.py's group table (a process group is no schema type);
# ``ranks`` is the group's size, there so that the fake kernel needs no run-time state.
_SEQUENCE_PARALLEL_LIB.define(
    "all_to_all(Tensor x, int scatter_dim, int gather_dim, int ranks, int group) -> Tensor")


def all_to_all_shape(shape: Sequence[int], scatter_dim: int, gather_dim: int, ranks: int) -> List[int]:
    """The shape ``dcsp::all_to_all`` returns for an input of ``shape``."""
    if shape[scatter_dim] % ranks:
        raise ValueError(f"all_to_all: dimension {scatter_dim} of {tuple(shape)} does not split into {ranks}")
    out = list(shape)
    out[scatter_dim] //= ranks
    out[gather_dim] *= ranks
    return out


def _fake_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, ranks: int, group: int) -> torch.Tensor:
    return x.new_empty(all_to_all_shape(x.shape, scatter_dim, gather_dim, ranks))


_SEQUENCE_PARALLEL_LIB.impl("all_to_all", _fake_all_to_all, "Meta")
_dcsp = getattr(torch.ops, SEQUENCE_PARALLEL_NAMESPACE)
ALL_TO_ALL = _dcsp.all_to_all.default


def _all_to_all_setup(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
    _, ctx.scatter_dim, ctx.gather_dim, ctx.ranks, ctx.group = inputs


def _all_to_all_backward(ctx: Any, grad: torch.Tensor):
    # The adjoint of an all-to-all is the all-to-all that undoes it: scatter where it gathered.
    return ALL_TO_ALL(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.ranks, ctx.group), None, None, None, None


torch.library.register_autograd(f"{SEQUENCE_PARALLEL_NAMESPACE}::all_to_all", _all_to_all_backward,
                                setup_context=_all_to_all_setup, lib=_SEQUENCE_PARALLEL_LIB)


def register_sequence_parallel_kernel(kernel: Callable) -> None:
    """The CPU and CUDA kernel of ``dcsp::all_to_all`` (it looks the group up by key)."""
    for dispatch_key in ("CPU", "CUDA"):
        _SEQUENCE_PARALLEL_LIB.impl("all_to_all", kernel, dispatch_key)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, ranks: int, group: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` over the ``ranks`` ranks of sequence-parallel group
    ``group`` and concatenate what they send along ``gather_dim`` (differentiable)."""
    return ALL_TO_ALL(x, scatter_dim, gather_dim, ranks, group)


# Packed sequences (compile.packed_sequences; kernels: sequence_parallel/documents.py and
# sequence_parallel/packed_attention.py). ``documents`` returns the forward's documents of the
# whole sequences attended over by ``like`` (a ``[B, H, S, D]`` query after the all-to-all; it also
# orders the op after it): ids ``[B, S]`` int32, bounds ``[B * S + 1]`` int32 and host counts ``[2]``
# int64 (documents.py). ``packed_attention`` is causal attention kept inside each document, returning the
# output and its log-sum-exp in a flat fp32 buffer of ``B * H * S`` (packed_attention.py).
_SEQUENCE_PARALLEL_LIB.define("documents(Tensor like, int group) -> (Tensor, Tensor, Tensor)")
_SEQUENCE_PARALLEL_LIB.define("packed_attention(Tensor q, Tensor k, Tensor v, Tensor ids, Tensor bounds, Tensor counts, "
                              "float? scale) -> (Tensor, Tensor)")
_SEQUENCE_PARALLEL_LIB.define("packed_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                              "Tensor ids, Tensor bounds, Tensor counts, float? scale) -> (Tensor, Tensor, Tensor)")


def _fake_documents(like: torch.Tensor, group: int):
    batch, length = like.shape[0], like.shape[2]
    return (like.new_empty((batch, length), dtype=torch.int32), like.new_empty((batch * length + 1,), dtype=torch.int32),
            torch.empty(2, dtype=torch.int64, device="cpu"))


def _fake_attention(q, k, v, ids, bounds, counts, scale):
    b, h, s, _ = q.shape
    return q.new_empty((b, h, s, v.shape[-1])), q.new_empty((b * h * s,), dtype=torch.float32)


def _fake_attention_backward(grad, q, k, v, out, lse, ids, bounds, counts, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the kernels return


# Fake kernels rather than Meta ones: the counts live on the host whatever the query's device.
for _name, _fake in (("documents", _fake_documents), ("packed_attention", _fake_attention),
                     ("packed_attention_backward", _fake_attention_backward)):
    torch.library.register_fake(f"{SEQUENCE_PARALLEL_NAMESPACE}::{_name}", _fake, lib=_SEQUENCE_PARALLEL_LIB)
DOCUMENTS = _dcsp.documents.default
PACKED_ATTENTION = _dcsp.packed_attention.default
PACKED_ATTENTION_BACKWARD = _dcsp.packed_attention_backward.default


def _packed_attention_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, ids, bounds, counts, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], ids, bounds, counts)


def _packed_attention_grad(ctx: Any, grad: torch.Tensor, _grad_lse: Optional[torch.Tensor]):
    q, k, v, out, lse, ids, bounds, counts = ctx.saved_tensors
    gq, gk, gv = PACKED_ATTENTION_BACKWARD(grad, q, k, v, out, lse, ids, bounds, counts, ctx.scale)
    return gq, gk, gv, None, None, None, None


torch.library.register_autograd(f"{SEQUENCE_PARALLEL_NAMESPACE}::packed_attention", _packed_attention_grad,
                                setup_context=_packed_attention_setup, lib=_SEQUENCE_PARALLEL_LIB)


def register_documents_kernel(kernel: Callable) -> None:
    """The CPU and CUDA kernel of ``dcsp::documents`` (it reads the documents the engine published)."""
    for dispatch_key in ("CPU", "CUDA"):
        _SEQUENCE_PARALLEL_LIB.impl("documents", kernel, dispatch_key)


def register_packed_attention_kernels(forward: Callable, backward: Callable) -> None:
    """The CPU and CUDA kernels of ``dcsp::packed_attention`` and its backward."""
    for dispatch_key in ("CPU", "CUDA"):
        _SEQUENCE_PARALLEL_LIB.impl("packed_attention", forward, dispatch_key)
        _SEQUENCE_PARALLEL_LIB.impl("packed_attention_backward", backward, dispatch_key)


def documents(like: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The documents (ids, bounds, host counts) published for sequence-parallel group ``group``."""
    return DOCUMENTS(like, group)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, bounds: torch.Tensor,
                     counts: torch.Tensor, scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal attention kept inside each document: the output and the flat log-sum-exp (differentiable)."""
    return PACKED_ATTENTION(q, k, v, ids, bounds, counts, scale)


def packed_attention_backward(grad, q, k, v, out, lse, ids, bounds, counts, scale=None):
    """The gradients of :func:`packed_attention` for ``q``, ``k`` and ``v``."""
    return PACKED_ATTENTION_BACKWARD(grad, q, k, v, out, lse, ids, bounds, counts, scale)


# ---- dcloss: the tiled loss (kernels: passes/tiled_loss_kernels.py) ---------------------------

_TILED_LOSS_LIB = torch.library.Library(TILED_LOSS_NAMESPACE, "DEF")
# cross_entropy(hidden @ weight.T, labels) without the [tokens, vocab] logits: ``hidden`` is
# [tokens, features], ``weight`` [vocab, features], ``labels`` [tokens]; ``reduction`` "mean"
# (over labels other than ``ignore_index``) or "sum"; ``chunk`` tokens at a time. The loss is fp32,
# as transformers' causal-LM losses are (they upcast the logits).
_TILED_LOSS_LIB.define("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, int ignore_index, "
                       "str reduction, int chunk) -> Tensor")
_TILED_LOSS_LIB.define("linear_cross_entropy_backward(Tensor grad, Tensor hidden, Tensor weight, Tensor labels, "
                       "int ignore_index, str reduction, int chunk) -> (Tensor, Tensor)")


def _fake_linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk):
    return hidden.new_empty((), dtype=torch.float32)


def _fake_linear_cross_entropy_backward(grad, hidden, weight, labels, ignore_index, reduction, chunk):
    return torch.empty_like(hidden), torch.empty_like(weight)


_TILED_LOSS_LIB.impl("linear_cross_entropy", _fake_linear_cross_entropy, "Meta")
_TILED_LOSS_LIB.impl("linear_cross_entropy_backward", _fake_linear_cross_entropy_backward, "Meta")
_dcloss = getattr(torch.ops, TILED_LOSS_NAMESPACE)
LINEAR_CROSS_ENTROPY = _dcloss.linear_cross_entropy.default
LINEAR_CROSS_ENTROPY_BACKWARD = _dcloss.linear_cross_entropy_backward.default


def _linear_cross_entropy_setup(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
    hidden, weight, labels, ctx.ignore_index, ctx.reduction, ctx.chunk = inputs
    ctx.save_for_backward(hidden, weight, labels)


def _linear_cross_entropy_grad(ctx: Any, grad: torch.Tensor):
    # The logits are recomputed a chunk at a time in the backward too: nothing of size
    # [tokens, vocab] is saved between the two.
    hidden, weight, labels = ctx.saved_tensors
    grad_hidden, grad_weight = LINEAR_CROSS_ENTROPY_BACKWARD(grad, hidden, weight, labels, ctx.ignore_index,
                                                             ctx.reduction, ctx.chunk)
    return grad_hidden, grad_weight, None, None, None, None


torch.library.register_autograd(f"{TILED_LOSS_NAMESPACE}::linear_cross_entropy", _linear_cross_entropy_grad,
                                setup_context=_linear_cross_entropy_setup, lib=_TILED_LOSS_LIB)


def register_tiled_loss_kernels(forward: Callable, backward: Callable) -> None:
    """The CPU and CUDA kernels of the two ``dcloss`` ops."""
    for dispatch_key in ("CPU", "CUDA"):
        _TILED_LOSS_LIB.impl("linear_cross_entropy", forward, dispatch_key)
        _TILED_LOSS_LIB.impl("linear_cross_entropy_backward", backward, dispatch_key)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                         reduction: str, chunk: int) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels)`` in fp32, ``chunk`` tokens at a time (differentiable)."""
    return LINEAR_CROSS_ENTROPY(hidden, weight, labels, ignore_index, reduction, chunk)


def linear_cross_entropy_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                  labels: torch.Tensor, ignore_index: int, reduction: str,
                                  chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`linear_cross_entropy` for ``hidden`` and ``weight``."""
    return LINEAR_CROSS_ENTROPY_BACKWARD(grad, hidden, weight, labels, ignore_index, reduction, chunk)


# ---- dcmlp: the tiled MLP (kernels: passes/tiled_mlp_kernels.py) ------------------------------

_TILED_MLP_LIB = torch.library.Library(TILED_MLP_NAMESPACE, "DEF")
# down(act(gate(x)) * up(x)) without its [tokens, intermediate] activations: ``x`` is [..., features],
# ``gate`` and ``up`` [intermediate, features], ``down`` [out, intermediate] (nn.Linear weights, no
# biases); ``activation`` a name of passes/tiled_mlp_kernels.ACTIVATIONS; ``chunk`` tokens at a time.
_TILED_MLP_LIB.define("gated_mlp(Tensor x, Tensor gate, Tensor up, Tensor down, str activation, int chunk) -> Tensor")
_TILED_MLP_LIB.define("gated_mlp_backward(Tensor grad, Tensor x, Tensor gate, Tensor up, Tensor down, "
                      "str activation, int chunk) -> (Tensor, Tensor, Tensor, Tensor)")


def _fake_gated_mlp(x, gate, up, down, activation, chunk):
    return x.new_empty((*x.shape[:-1], down.shape[0]))


def _fake_gated_mlp_backward(grad, x, gate, up, down, activation, chunk):
    return torch.empty_like(x), torch.empty_like(gate), torch.empty_like(up), torch.empty_like(down)


_TILED_MLP_LIB.impl("gated_mlp", _fake_gated_mlp, "Meta")
_TILED_MLP_LIB.impl("gated_mlp_backward", _fake_gated_mlp_backward, "Meta")
_dcmlp = getattr(torch.ops, TILED_MLP_NAMESPACE)
GATED_MLP = _dcmlp.gated_mlp.default
GATED_MLP_BACKWARD = _dcmlp.gated_mlp_backward.default


def _gated_mlp_setup(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
    x, gate, up, down, ctx.activation, ctx.chunk = inputs
    ctx.save_for_backward(x, gate, up, down)


def _gated_mlp_grad(ctx: Any, grad: torch.Tensor):
    # Only the input and the weights are saved: the backward recomputes the intermediates a chunk
    # at a time.
    x, gate, up, down = ctx.saved_tensors
    grads = GATED_MLP_BACKWARD(grad.contiguous(), x, gate, up, down, ctx.activation, ctx.chunk)
    return (*grads, None, None)


torch.library.register_autograd(f"{TILED_MLP_NAMESPACE}::gated_mlp", _gated_mlp_grad, setup_context=_gated_mlp_setup,
                                lib=_TILED_MLP_LIB)


def register_tiled_mlp_kernels(forward: Callable, backward: Callable) -> None:
    """The CPU and CUDA kernels of the two ``dcmlp`` ops."""
    for dispatch_key in ("CPU", "CUDA"):
        _TILED_MLP_LIB.impl("gated_mlp", forward, dispatch_key)
        _TILED_MLP_LIB.impl("gated_mlp_backward", backward, dispatch_key)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str,
              chunk: int) -> torch.Tensor:
    """``F.linear(act(F.linear(x, gate)) * F.linear(x, up), down)``, ``chunk`` tokens at a time (differentiable)."""
    return GATED_MLP(x, gate, up, down, activation, chunk)


def gated_mlp_backward(grad: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       down: torch.Tensor, activation: str,
                       chunk: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`gated_mlp` for ``x``, ``gate``, ``up`` and ``down``."""
    return GATED_MLP_BACKWARD(grad, x, gate, up, down, activation, chunk)


# ---- the registry ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """One operator: its qualified name (``dc::allgather_param``), the wrapper eager code calls,
    its overloads by name, and where its fake kernel is."""

    name: str
    wrapper: Callable
    overloads: Dict[str, Any]
    fake: str

    @property
    def qualified_names(self) -> Tuple[str, ...]:
        """As the dispatcher lists them: ``dc::allgather_param`` and ``dc::allgather_param.slot``."""
        return tuple(self.name if o == "default" else f"{self.name}.{o}" for o in self.overloads)


_CPP_FAKE = "csrc/ops.cpp, TORCH_LIBRARY_IMPL(dc, Meta)"


def _dc_entry(wrapper: Callable, default: Any, slot: Any = None) -> OpEntry:
    overloads = {"default": default, **({"slot": slot} if slot is not None else {})}
    return OpEntry(f"{RUNTIME_NAMESPACE}::{wrapper.__name__}", wrapper, overloads, _CPP_FAKE)


def _dcact_entry(wrapper: Callable, default: Any) -> OpEntry:
    name = wrapper.__name__
    return OpEntry(f"{ACTIVATION_NAMESPACE}::{name}", wrapper, {"default": default},
                   f"deepcompile/ops.py, {_ACTIVATION_FAKES[name].__name__}")


REGISTRY: Tuple[OpEntry, ...] = (
    _dc_entry(allgather_param, ALLGATHER_PARAM, ALLGATHER_PARAM_SLOT),
    _dc_entry(prefetch_params_fused, PREFETCH_PARAMS_FUSED, PREFETCH_PARAMS_FUSED_SLOT),
    _dc_entry(wait_allgather, WAIT_ALLGATHER, WAIT_ALLGATHER_SLOT),
    _dc_entry(release_param, RELEASE_PARAM, RELEASE_PARAM_SLOT),
    _dc_entry(reduce_grad, REDUCE_GRAD, REDUCE_GRAD_SLOT),
    _dc_entry(end_backward, END_BACKWARD, END_BACKWARD_SLOT),
    _dc_entry(free_tensors, FREE_TENSORS),
    _dcact_entry(offload_activation, OFFLOAD_ACTIVATION),
    _dcact_entry(reload_activation, RELOAD_ACTIVATION),
    _dcact_entry(wait_reload, WAIT_RELOAD),
    _dcact_entry(free_after, FREE_AFTER),
    OpEntry(f"{SEQUENCE_PARALLEL_NAMESPACE}::all_to_all", all_to_all, {"default": ALL_TO_ALL},
            "deepcompile/ops.py, _fake_all_to_all"),
    OpEntry(f"{SEQUENCE_PARALLEL_NAMESPACE}::documents", documents, {"default": DOCUMENTS},
            "deepcompile/ops.py, _fake_documents"),
    OpEntry(f"{SEQUENCE_PARALLEL_NAMESPACE}::packed_attention", packed_attention, {"default": PACKED_ATTENTION},
            "deepcompile/ops.py, _fake_attention"),
    OpEntry(f"{SEQUENCE_PARALLEL_NAMESPACE}::packed_attention_backward", packed_attention_backward,
            {"default": PACKED_ATTENTION_BACKWARD}, "deepcompile/ops.py, _fake_attention_backward"),
    OpEntry(f"{TILED_LOSS_NAMESPACE}::linear_cross_entropy", linear_cross_entropy,
            {"default": LINEAR_CROSS_ENTROPY}, "deepcompile/ops.py, _fake_linear_cross_entropy"),
    OpEntry(f"{TILED_LOSS_NAMESPACE}::linear_cross_entropy_backward", linear_cross_entropy_backward,
            {"default": LINEAR_CROSS_ENTROPY_BACKWARD}, "deepcompile/ops.py, _fake_linear_cross_entropy_backward"),
    OpEntry(f"{TILED_MLP_NAMESPACE}::gated_mlp", gated_mlp, {"default": GATED_MLP}, "deepcompile/ops.py, _fake_gated_mlp"),
    OpEntry(f"{TILED_MLP_NAMESPACE}::gated_mlp_backward", gated_mlp_backward, {"default": GATED_MLP_BACKWARD},
            "deepcompile/ops.py, _fake_gated_mlp_backward"),
)

# Graphs call these for their effect alone (their results, if any, unused): dead-code removal must
# keep them (compat.mark_ops_side_effectful).
SIDE_EFFECTFUL: Tuple[Any, ...] = (
    FREE_TENSORS,
    END_BACKWARD, END_BACKWARD_SLOT,
    REDUCE_GRAD, REDUCE_GRAD_SLOT,
    RELEASE_PARAM, RELEASE_PARAM_SLOT,
    PREFETCH_PARAMS_FUSED, PREFETCH_PARAMS_FUSED_SLOT,
    WAIT_ALLGATHER, WAIT_ALLGATHER_SLOT,
    OFFLOAD_ACTIVATION, RELOAD_ACTIVATION, WAIT_RELOAD, FREE_AFTER,
)

# Ops whose buffers Inductor must not recycle (compat.protect_runtime_buffers_in_inductor says
# why): (overload, protect its inputs, protect its outputs). Gathered parameters are freed by the
# runtime; gradients handed to reduce_grad are read by the copy lane after the op returns.
INDUCTOR_PROTECTED_BUFFERS: Tuple[Tuple[Any, bool, bool], ...] = tuple(
    (op, inputs, outputs)
    for pair, inputs, outputs in (((ALLGATHER_PARAM, ALLGATHER_PARAM_SLOT), False, True),
                                  ((WAIT_ALLGATHER, WAIT_ALLGATHER_SLOT), True, True),
                                  ((REDUCE_GRAD, REDUCE_GRAD_SLOT), True, True))
    for op in pair)

# Ops that return (an alias of) their tensor input: passes follow a value through them.
ALIASING: Tuple[Any, ...] = (WAIT_ALLGATHER, RELEASE_PARAM)


def registered_names() -> List[str]:
    """Every qualified name the registry lists (``dc::allgather_param.slot`` included)."""
    return [name for entry in REGISTRY for name in entry.qualified_names]
