"""Activation checkpointing under ZeRO-1/2/3: ``torch.utils.checkpoint.checkpoint`` around decoder
layers (``use_reentrant`` False and True) and transformers' ``gradient_checkpointing_enable()``,
with the engine compiled by the eager and the Inductor backend, or not compiled at all.

Every case trains against single-process training of the same model on the same global batch
(tolerances of test_zero3_parity.py: fp32 1e-5, Inductor 1e-4 for its reordered sums), with
``compile.debug_checks`` on: no compiled graph reads a placeholder other than through a gather, the
loss and every reduced gradient are finite (a NaN placeholder reaching a computation fails here),
and the gradients the runtime received match the ones produced, window by window. Beyond that,
each backward is watched:

* what it gathers. The recomputation must re-gather what it reads. A bias of a checkpointed layer
  is read by no gradient formula, only by recomputing the layer's forward, so a compiled backward
  gathers it only if it recomputes; run eagerly (no compile, or a layer Dynamo cannot trace), the
  recomputed layer is gathered by the module hooks again, each parameter exactly once;
* that nothing stays gathered after it (the recomputation's gathers are released);
* that every trainable parameter's gradient was reduced exactly once per micro-step.

Under Dynamo both checkpoint implementations are traced into the graph (torch's
``tag_activation_checkpoint``), and the partitioner recomputes the tagged region in the backward
graph, where the ZeRO-3 pass gathers for it. A layer Dynamo cannot trace in one piece makes the
whole ``checkpoint`` call run eagerly (``broken_ckpt*``), as does the engine without compile().
"""

from __future__ import annotations

import collections
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from _harness import checkpointing_cases  # noqa: F401  (registers the models)
from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, RunResult, assert_parity, batch, build_model, make_optimizer, train_reference
from test_zero3_parity import FP32_TOL, INDUCTOR_TOL

WORLD = single_world_size()  # the transformers models: 2 ranks (or DC_TEST_WORLD_SIZES)
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
EAGER_GRAPH_ID = 0


def _config(stage: int, gas: int, compile_keys: Optional[dict] = None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 64}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter is gathered and released
        zero["stage3_prefetch_bucket_size"] = 40  # several prefetch groups in these small models
    return {"zero_optimization": zero, "gradient_accumulation_steps": gas,
            "compile": {"debug_checks": True, **(compile_keys or {})}}


class _GatherCounter(TorchDispatchMode):
    """Counts ``dc.allgather_param`` calls per (graph id, ds id): those of compiled graphs and of
    the eager module hooks alike go through the dispatcher."""

    # Higher-order operators (``run_with_rng_state`` replaying a recomputed random op) pass
    # through and run as they are: no gather is issued inside one.
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.dc.allgather_param.default:
            self.counts[(args[1], args[2])] += 1
        elif func is torch.ops.dc.allgather_param.slot:  # compiled code: graph instance and slot as data
            from deepcompile import runtime

            graph_id = int(args[1])
            self.counts[(graph_id, runtime.graph_param_ids(graph_id)[args[2]])] += 1
        return func(*args, **(kwargs or {}))


def _layer_params(names: Dict[int, str]) -> Dict[int, str]:
    return {ds_id: name for ds_id, name in names.items() if ".layers." in f".{name}"}


def _check_recomputation(expect: str, gathers: collections.Counter, names: Dict[int, str], step: int) -> None:
    """``gathers``: one backward's gathers. ``expect``:

    * "compiled": the backward graph recomputes each checkpointed layer: every ``up.bias`` (read
      only by the recomputation) is gathered there;
    * "none": the same model without checkpointing: no ``up.bias`` is gathered in the backward
      (the control that makes "compiled" mean something);
    * "eager": the layers' forwards run again in the backward, gathered by the module hooks:
      every layer parameter exactly once, by the eager graph id;
    * "layers": every layer parameter is gathered by the backward (transformers models, whose
      gradient formulas read every weight anyway: weaker, parity carries the rest).
    """
    in_backward = collections.Counter()
    for (graph_id, ds_id), n in gathers.items():
        in_backward[names[ds_id]] += n
    layers = _layer_params(names)
    if expect in ("compiled", "none"):
        biases = [name for name in layers.values() if name.endswith("up.bias")]
        assert biases
        gathered = [name for name in biases if in_backward[name]]
        if expect == "compiled":
            assert gathered == biases, f"step {step}: the backward did not re-gather {sorted(set(biases) - set(gathered))}"
        else:
            assert not gathered, f"step {step}: gathered in a backward without recomputation: {gathered}"
    elif expect == "eager":
        eager = {names[ds_id]: n for (graph_id, ds_id), n in gathers.items() if graph_id == EAGER_GRAPH_ID}
        wanted = {name: 1 for name in layers.values()}
        assert {k: v for k, v in eager.items() if k in wanted} == wanted, \
            f"step {step}: the recomputed layers were gathered {eager}, expected each layer parameter once"
    elif expect == "layers":
        missing = [name for name in layers.values() if not in_backward[name]]
        assert not missing, f"step {step}: the backward never gathered {missing}"
    else:
        raise ValueError(expect)


def _body(ctx, name: str, stage: int, backend: Optional[str], expect: Optional[str], steps: int = 3, gas: int = 1,
          compile_keys: Optional[dict] = None):
    import deepcompile
    from deepcompile import runtime

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(name, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _config(stage, gas, compile_keys))
    if backend is not None:
        engine.compile(backend=backend)
    names = engine.sharding.param_names()
    n = GLOBAL_BATCH // world
    losses: List[float] = []
    norms: List[float] = []
    for step in range(steps):
        a, b = batch(name, step, device=ctx.device)
        loss = engine(a[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n])
        with _GatherCounter() as counter:
            engine.backward(loss)
        if stage == 3:
            if expect is not None:
                _check_recomputation(expect, counter.counts, names, step)
            held = [names[i] for i in names if runtime.is_gathered(i) and not runtime.is_persistent(i)]
            assert not held, f"step {step}: still gathered after the backward: {held}"
        if engine.is_gradient_accumulation_boundary():
            counts = runtime.reduce_counts()
            wrong = {names[i]: counts.get(i, 0) for i in names if counts.get(i, 0) != gas}
            assert not wrong, f"step {step}: gradients reduced other than once per micro-step ({gas}): {wrong}"
        norm = engine.step()
        if norm is not None:
            norms.append(norm.item())
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    assert engine._ledger.windows_checked == steps // gas
    if stage == 3 and expect in ("compiled", "none", "layers") and not name.startswith("qwen2_moe"):
        # The checkpointed layers were traced into the graphs, not run eagerly beside them.
        # (Qwen2-MoE's expert kernel may run eagerly, as leaves, depending on the transformers
        # version: test_zero3_parity.py::test_zero3_qwen2_moe.)
        eager = engine.eagerly_gathered_params()
        assert not eager, f"gathered outside compiled graphs: {eager}"
    if compile_keys:  # the profile-guided passes: a complete profile of the recomputing graphs
        report = engine.schedule_report()
        assert report and report["entry"] == "step 2: prefetch, selective_gather", report
        assert report["graphs"] and all(g["profile_complete"] for g in report["graphs"]), report
    got = RunResult(losses, {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}, norms)
    engine.destroy()
    ref = train_reference(name, steps, gas=gas, device=ctx.device)
    assert_parity(got, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))


@pytest.mark.parametrize("name,stage,backend,expect", [
    ("decoder_ckpt", 3, "eager", "compiled"),
    ("decoder_ckpt_reentrant", 3, "eager", "compiled"),
    ("decoder_ckpt", 3, "inductor", "compiled"),
    ("decoder_ckpt_reentrant", 3, "inductor", "compiled"),
    ("decoder", 3, "eager", "none"),  # the control
    ("decoder_ckpt", 3, None, "eager"),
    ("decoder_ckpt_reentrant", 3, None, "eager"),
    # A layer Dynamo cannot trace: the checkpoint call runs eagerly, its layers gathered by hooks.
    ("broken_ckpt", 3, "eager", "eager"),
    ("broken_ckpt_reentrant", 3, "inductor", "eager"),
    ("decoder_ckpt", 1, "eager", None),
    ("decoder_ckpt_reentrant", 1, "inductor", None),
    ("decoder_ckpt_reentrant", 2, "eager", None),
    ("decoder_ckpt", 2, "inductor", None),
])
def test_checkpointed_decoder(dist_world_size, name, stage, backend, expect):
    run_distributed(_body, dist_world_size, args=(name, stage, backend, expect), timeout=600)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpointed_decoder_gradient_accumulation(dist_world_size, stage):
    """Two windows of two micro-steps: every recomputing backward reduces once into the window."""
    run_distributed(_body, dist_world_size, args=("decoder_ckpt_reentrant", stage, "eager", None),
                    kwargs={"steps": 4, "gas": 2}, timeout=600)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_checkpointed_decoder_with_prefetch_and_selective_gather(dist_world_size, backend):
    """ZeRO-3's profile-guided passes (profiled at step 1, planned for step 2 on): prefetches and
    persistent parameters in backward graphs that recompute, next to the recomputation's
    gathers and their releases."""
    run_distributed(_body, dist_world_size, args=("decoder_ckpt", 3, backend, "compiled"),
                    kwargs={"steps": 5, "compile_keys": {"warmup_steps": 2}}, timeout=600)


@pytest.mark.parametrize("name,stage,backend,expect", [
    ("llama_ckpt", 3, "eager", "layers"),
    ("llama_ckpt_reentrant", 3, "eager", "layers"),
    ("llama_ckpt", 3, "inductor", "layers"),
    ("llama_ckpt_reentrant", 3, None, "eager"),
    ("llama_ckpt", 1, "eager", None),
    ("llama_ckpt_reentrant", 2, "eager", None),
    ("qwen2_moe_ckpt", 3, "eager", "layers"),
])
def test_transformers_gradient_checkpointing(name, stage, backend, expect):
    """transformers' ``gradient_checkpointing_enable()``: its default (non-reentrant) and
    ``gradient_checkpointing_kwargs={"use_reentrant": True}``, on a real LlamaForCausalLM and
    Qwen2-MoE."""
    run_distributed(_body, WORLD, args=(name, stage, backend, expect), timeout=900)


def test_readers_no_release_depends_on_get_releases_of_their_own():
    """The shape of a backward that recomputes a checkpointed layer: the recomputation
    (``x @ w.t()``) and the input gradient (``g @ w``) both read ``w`` and neither depends on the
    other. Inductor orders nodes by data dependencies (and fuses across graph order), so a single
    release after the later one in graph order could run before the other reader: each gets a
    release, and the runtime frees the buffer at the last of ``n_users`` (passes/zero3.py)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import deepcompile  # noqa: F401  (loads torch.ops.dc)
    from deepcompile.passes.zero3 import insert_gather_release

    def backward_like(w, x, g):
        recomputed = torch.tanh(x @ w.t())
        grad_input = g @ w
        return recomputed, grad_input

    placeholder = torch.full((1, 1), float("nan")).expand(5, 3)
    gm = make_fx(backward_like, tracing_mode="fake")(placeholder, torch.randn(4, 3), torch.randn(4, 5))
    w = next(n for n in gm.graph.nodes if n.op == "placeholder")
    insert_gather_release(gm, graph_id=1, params={w: 0})
    releases = [n for n in gm.graph.nodes if n.target is torch.ops.dc.release_param.default]
    readers = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(readers) == 2 and len(releases) == 2
    assert all(r.args[3] == 2 for r in releases)  # n_users: the episode ends at the second release

    def ancestors(node):
        seen, stack = set(), [node]
        while stack:
            for a in stack.pop().all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    stack.append(a)
        return seen

    covered = set().union(*(ancestors(r) for r in releases))
    assert all(reader in covered for reader in readers), "a reader may run after every release"


def test_readers_in_one_chain_keep_a_single_release():
    """Without checkpointing the readers of a parameter form a chain (the later one consumes the
    earlier one's result): one release, as before."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import deepcompile  # noqa: F401
    from deepcompile.passes.zero3 import insert_gather_release

    def forward_like(w, x):
        return (torch.tanh(x @ w.t()) @ w).sum()

    placeholder = torch.full((1, 1), float("nan")).expand(3, 3)
    gm = make_fx(forward_like, tracing_mode="fake")(placeholder, torch.randn(4, 3))
    w = next(n for n in gm.graph.nodes if n.op == "placeholder")
    insert_gather_release(gm, graph_id=1, params={w: 0})
    releases = [n for n in gm.graph.nodes if n.target is torch.ops.dc.release_param.default]
    assert [r.args[3] for r in releases] == [1]
