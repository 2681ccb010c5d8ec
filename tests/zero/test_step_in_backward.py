"""``compile.optimizer_step_in_backward``: ZeRO-3 parameters step during the backward, as soon as
their gradient of the window is final, and their gradient partitions are freed then
(deepcompile/zero/backward_step.py).

Each case trains the same model twice on the same batches, with the option on and off, and asserts:

* the losses and the parameters are *bitwise* equal: the step over a subset is the normal step's
  arithmetic (zero/sub_groups.py), the gradients are the same reductions, and the learning rate is
  the same; a parameter stepped before its last gradient, or stepped twice, or read after its
  update by the same backward, would differ;
* both match single-process training on the same global batch (the parity suites' tolerances);
* the global gradient norm reported by the step is the same (the early-stepped gradients count);
* from the first window after an exact one (nothing profiled) on, every layer parameter stepped
  in the backward and, when the backward returns, holds no gradient partition any more (what
  lowers the memory), while the parameters outside the compiled layers (run eagerly) still do and
  step in ``engine.step()``. Layer parameters of leaf modules (run eagerly inside a compiled
  layer, reduced by the leaf's backward) count as layer parameters: they step after the next
  layer graph (``test_step_in_backward_with_leaf_experts``; on CUDA the plain Qwen2-MoE case too,
  whose experts the backend makes leaves).
"""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _harness import checkpointing_cases  # noqa: F401  (registers the checkpointed models)
from _harness.checkpointing_cases import DecoderLayer
from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, RunResult, assert_parity, batch, build_model, make_optimizer, train_reference
from test_zero3_parity import FP32_TOL, INDUCTOR_TOL

WORLD = single_world_size()
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)


def _config(on: bool, gas: int = 1, extra: Optional[dict] = None, persistence: int = 0) -> dict:
    return {"zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": persistence},
            "gradient_accumulation_steps": gas,
            # Window 0 is profiled (plan for step 1), window 1 is the first exact one: from window
            # 2 on, parameters step in the backward.
            "compile": {"warmup_steps": 1, "selective_gather": False, "optimizer_step_in_backward": on,
                        **(extra or {})}}


def _train(ctx, name: str, backend: str, regional, on: bool, steps: int, gas: int, extra: Optional[dict] = None,
           persistence: int = 0, optimizer: str = "adamw", leaf_experts: bool = False):
    import deepcompile
    from deepcompile import runtime
    from deepcompile.zero.leaf_modules import leaf_parameters, leaves_of

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(name, device=ctx.device)
    if leaf_experts:  # what the backend does on its own where the experts' graph cannot compile (CUDA)
        deepcompile.set_leaf_modules(model, [type(model.model.model.layers[0].mlp.experts)])
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), optimizer),
                                    _config(on, gas, extra, persistence))
    engine.compile(backend=backend, regional=regional)
    names = engine.sharding.param_names()
    layer_ids = {i for i, n in names.items() if ".layers." in f".{n}"}
    n = GLOBAL_BATCH // world
    losses: List[float] = []
    norms: List[float] = []
    stepped_early: List[set] = []
    for step in range(steps):
        a, b = batch(name, step, device=ctx.device)
        loss = engine(a[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n])
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        counts = runtime.reduce_counts()  # the per-parameter accessor the step in backward reads agrees
        assert all(runtime.reduce_count(i) == counts[i] for i in names)
        if on and boundary and step // gas >= 2:
            held = sorted(names[i] for i in layer_ids if runtime.holds_grad_target(i))
            assert not held, f"step {step}: layer gradients still held after the backward: {held}"
            outside = [i for i in names if i not in layer_ids]
            assert outside and all(runtime.holds_grad_target(i) for i in outside), \
                f"step {step}: the eager parameters' gradients should wait for engine.step()"
        engine.step()
        if boundary:
            norms.append(engine.get_global_grad_norm())
            if on:
                stepped_early.append(set(engine.sharding.backward_step.stepped_last_window))
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if on:
        windows = steps // gas
        assert stepped_early[:2] == [set(), set()], "the first two windows (profiled, then learning) step as before"
        assert all(s == layer_ids for s in stepped_early[2:]) and windows > 2, \
            f"expected every layer parameter stepped in the backward from window 2 on: {stepped_early}"
        # Leaves (marked up front, or by the backend where a graph could not compile): their
        # parameters are reduced by eager code and still stepped in the backward (checked above).
        leaf_ids = {engine.sharding.ds_id_of[id(p)] for leaf in leaves_of(model) for _, _, p in leaf_parameters(leaf)}
        assert leaf_ids <= layer_ids, f"leaves outside the layers: {sorted(names[i] for i in leaf_ids - layer_ids)}"
        if leaf_experts:
            assert leaf_ids == {i for i, n in names.items() if ".mlp.experts." in n}, \
                f"expected the experts of every layer as leaves: {sorted(names[i] for i in leaf_ids)}"
    result = RunResult(losses, {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}, norms)
    engine.destroy()
    return result


def _body(ctx, name: str, backend: str, regional, steps: int = 5, gas: int = 1, extra: Optional[dict] = None,
          persistence: int = 0, optimizer: str = "adamw", leaf_experts: bool = False):
    on = _train(ctx, name, backend, regional, True, steps, gas, extra, persistence, optimizer, leaf_experts)
    off = _train(ctx, name, backend, regional, False, steps, gas, extra, persistence, optimizer, leaf_experts)
    assert on.losses == off.losses, f"losses differ: {on.losses} vs {off.losses}"
    for key, value in off.params.items():
        assert torch.equal(on.params[key], value), f"{key} differs from the run with the step after the backward"
    torch.testing.assert_close(torch.tensor(on.grad_norms), torch.tensor(off.grad_norms), rtol=1e-6, atol=0)
    # The norms against the reference too (assert_parity): the same norm on and off proves the
    # early-stepped gradients count, not that either is the gradient of the global batch.
    ref = train_reference(name, steps, gas=gas, device=ctx.device, optimizer=optimizer)
    assert_parity(on, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))


@pytest.mark.parametrize("name,backend", [("decoder_ckpt", "eager"), ("decoder", "eager"),
                                          ("decoder_ckpt_reentrant", "inductor")])
def test_step_in_backward_checkpointed_decoder(dist_world_size, name, backend):
    run_distributed(_body, dist_world_size, args=(name, backend, [DecoderLayer]), timeout=600)


def test_step_in_backward_sgd_momentum():
    """The first case under SGD with momentum, whose update scales with the gradient: a
    parameter stepped in the backward from a gradient scaled wrongly (a partial window, a missing
    average) moves by the wrong amount, which AdamW's normalised update would hide."""
    run_distributed(_body, WORLD, args=("decoder_ckpt", "eager", [DecoderLayer]),
                    kwargs={"optimizer": "sgd_momentum"}, timeout=600)


def test_step_in_backward_gradient_accumulation(dist_world_size):
    """Two micro-steps per window: parameters step only in the last micro-step's backward, after
    both reductions; with compile.debug_checks (the ledger and finite checks of the gradients
    stepped early) on."""
    run_distributed(_body, dist_world_size, args=("decoder_ckpt", "eager", [DecoderLayer]),
                    kwargs={"steps": 8, "gas": 2, "extra": {"debug_checks": True}}, timeout=600)


def test_step_in_backward_with_prefetch_and_persistent_parameters(dist_world_size):
    """Parameters below the persistence threshold (norms, biases) stay gathered between steps,
    and after the profiled window the plan prefetches and keeps more gathered: a parameter that
    steps in the backward must not be read from a stale gathered copy by the next forward."""
    run_distributed(_body, dist_world_size, args=("decoder_ckpt", "inductor", [DecoderLayer]),
                    kwargs={"steps": 6, "extra": {"selective_gather": True}, "persistence": 20}, timeout=600)


@pytest.mark.parametrize("name,backend", [("llama_ckpt", "inductor"), ("qwen2_moe", "eager")])
def test_step_in_backward_transformers(name, backend):
    """transformers models, each decoder layer compiled on its own (``regional=True``):
    LlamaForCausalLM with ``gradient_checkpointing_enable()`` under Inductor, and Qwen2-MoE, whose
    router sends tokens to different experts in every step (every expert of a layer graph is
    still reduced once per micro-step, so every layer parameter steps in the backward)."""
    run_distributed(_body, WORLD, args=(name, backend, True), timeout=900)


def test_step_in_backward_with_leaf_experts():
    """Qwen2-MoE with its experts run eagerly as leaf modules (``set_leaf_modules``), as the
    backend makes them on its own where their graph cannot compile (CUDA: transformers' grouped-mm
    experts). The leaf's backward reduces the experts' gradients outside any compiled graph; they
    still step in the backward, after the next layer graph's ``end_backward`` has flushed them."""
    run_distributed(_body, WORLD, args=("qwen2_moe", "eager", True), kwargs={"leaf_experts": True}, timeout=900)


# ---- a parameter used more often than in the windows it was learned from -----------------------


class GrowingUse(nn.Module):
    """Input projection, two decoder layers, head; from ``extra_from`` on, layer 0 runs twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 7)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(2)])
        self.head = nn.Linear(7, 5)
        self.repeat_first = False

    def forward(self, x, y):
        h = self.inp(x)
        if self.repeat_first:
            h = self.layers[0](h)
        for layer in self.layers:
            h = layer(h)
        return ((self.head(h) - y) ** 2).mean()


def _growing_body(ctx):
    import deepcompile
    from deepcompile.zero.backward_step import StepInBackwardError

    torch.manual_seed(0)
    model = GrowingUse()
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _config(True))
    engine.compile(backend="eager", regional=[DecoderLayer])
    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world
    for step in range(4):
        a, b = batch("decoder", step, device=ctx.device)
        model.repeat_first = step == 3  # windows 0-2 learn one use of layer 0; window 3 has two
        loss = engine(a[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n])
        if step < 3:
            engine.backward(loss)
            engine.step()
            continue
        with pytest.raises(StepInBackwardError, match=r"received a gradient after their optimizer step in this window: layers\.0\."):
            engine.backward(loss)
    engine.destroy()


def test_step_in_backward_refuses_a_gradient_after_the_step(dist_world_size):
    """Stepped after its one learned reduction, layer 0 then gets a second gradient: the error
    names it instead of training on a partial gradient."""
    run_distributed(_growing_body, dist_world_size, timeout=600)


def _uncompiled_body(ctx):
    import warnings

    import deepcompile

    model = build_model("decoder", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), _config(True))
    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            a, b = batch("decoder", step, device=ctx.device)
            engine.backward(engine(a[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n]))
            engine.step()
    said = [str(w.message) for w in caught if "optimizer_step_in_backward" in str(w.message)]
    # Window 0 learns the counts; window 1 is armed and no graph ran: one warning, on rank 0.
    assert len(said) == (1 if rank == 0 else 0), said
    assert all("no compiled backward graph ran" in m for m in said), said
    assert engine.sharding.backward_step.stepped_last_window == []
    engine.destroy()


def test_step_in_backward_says_when_nothing_is_compiled(dist_world_size):
    """Without engine.compile() there is no graph to step after: training is unchanged and the
    option says so once, instead of being accepted without effect."""
    run_distributed(_uncompiled_body, dist_world_size, timeout=600)


# ---- refused combinations ---------------------------------------------------------------------


@pytest.mark.parametrize("change,expected", [
    ({"zero_optimization": {"stage": 2}}, "built for ZeRO-3"),
    ({"gradient_clipping": 1.0}, "clipping scales every gradient"),
    ({"compile": {"offload_opt_states": True}}, "compile.offload_opt_states"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "zero_optimization.offload_optimizer"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param"),
])
def test_step_in_backward_refused_with(change, expected):
    from deepcompile.config import Config, ConfigError

    config = {"zero_optimization": {"stage": 3}, "compile": {"optimizer_step_in_backward": True}}
    for section, values in change.items():
        config[section] = {**config[section], **values} if isinstance(values, dict) else values
    with pytest.raises(ConfigError, match=expected):
        Config.from_dict(config)
    config["compile"]["optimizer_step_in_backward"] = False
    Config.from_dict(config)  # the same settings are fine without it
