"""Per-layer graphs (engine.compile(regional=True)) against the whole-model graph: the same
training, and the same or better prefetch coverage, counted at run time.

The count (``InstanceChain.counting``, scheduling/instance_chain.py): at the start of every unit
of a step (a graph half, an eager module outside the layers, the start of the step), how many of
the parameters it gathers first were already in flight or valid (launched ahead by the unit
before it) and how many were not (*cold*: gathered at the unit's head, or by the eager hook at
use, with nothing run between issue and use). Inside a graph the prefetch plan launches every
later group one group ahead, which the plans in the schedule report show. So the gathers not
launched ahead of their unit are the cold ones, and for the whole-model graph those are the head
group of its forward and of its backward.

A tiny 4-layer Llama (ZeRO-3, eager inner backend, nothing persistent, so that every parameter is
gathered through the prefetch path), 1 and 2 gloo ranks, 4 steps: step 0 plain and profiled, the
plan from step 1 on, counted over steps 1-3.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from _harness import multiproc
from _harness.multiproc import run_distributed
from _harness.parity_cases import make_optimizer, run_steps

# Both runs execute the same ATen kernels on the same values in the same order per layer; a
# parameter gathered late, twice or not at all shows as a NaN (parameters are NaN placeholders
# until gathered) or as a wrong update, far outside fp32's 1e-5 relative (the other parity
# suites' tolerance for eager fp32).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 4
COUNTED_STEPS = STEPS - 1


class _Llama4(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=37, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          tie_word_embeddings=False, attn_implementation="eager")
        self.model = LlamaForCausalLM(cfg)

    def forward(self, tokens, targets):
        return self.model(input_ids=tokens, labels=targets, use_cache=False).loss


def _train(ctx, regional: bool, selective: bool = False):
    """Trains the 4-layer Llama; returns the run, the chain's counts over the steps after the
    plan switch, the schedule report, the engine."""
    import deepcompile

    torch._dynamo.reset()
    torch.manual_seed(1234)
    model = _Llama4().to(ctx.device)
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 600},
              "gradient_accumulation_steps": 1,
              "compile": {"warmup_steps": 1, "selective_gather": selective}}
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), config)
    engine.compile(backend="eager", regional=regional)
    chain = engine.scheduler.chain
    chain.counting = True

    def after_step(engine, step):
        if step == 0:  # the plan switched at this step's end: count what runs under it
            chain.reset_counts()
            after_step.launched = chain.launched

    result = run_steps(engine, "llama", STEPS, ctx.device, after_step=after_step)
    counts = types.SimpleNamespace(**chain.report())
    counts.launched -= after_step.launched
    return result, counts, engine.schedule_report(), engine


def _every_group_ahead(report) -> None:
    """Inside every planned graph, every prefetch group is launched ahead of its first use (no
    gather waits on a group launched at its use)."""
    plans = [g for g in report["graphs"] if g["prefetch"] is not None]
    assert plans, report["graphs"]
    late = [(g["graph"], p["params"]) for g in plans for p in g["prefetch"] if not p["ahead"]]
    assert not late, late


def _parity_body(ctx):
    whole, whole_counts, whole_report, engine = _train(ctx, regional=False)
    engine.destroy()
    regional, counts, report, engine = _train(ctx, regional=True)
    layers = len(engine.module.model.model.layers)
    # The shared layer graph is planned from all its instances' profiles (instance_profiles.py).
    driver = engine.scheduler
    shared = {key: ids for key, ids in driver.chain.instances_of.items() if len(ids) > 1}
    assert {phase for phase, _ in shared} == {"forward", "backward"}, driver.chain.instances_of
    for sig, profile in driver.profiles.items():
        ids = shared.get((profile.phase, profile.graph_id))
        if ids:  # its plan keeps to the instance profiled highest (on GPUs a later layer, more activations alive)
            highest = max(p.peak_bytes for p in driver.profiles.values() if p.phase == profile.phase
                          and p.graph_id in ids)
            assert driver._plan_profile(sig).peak_bytes == highest, (sig, highest)
    engine.destroy()
    tag = f"whole-model {vars(whole_counts)}, regional {vars(counts)}"

    # (c) the same training.
    torch.testing.assert_close(torch.tensor(regional.losses), torch.tensor(whole.losses), **FP32_TOL)
    torch.testing.assert_close(torch.tensor(regional.grad_norms, dtype=torch.float64),
                               torch.tensor(whole.grad_norms, dtype=torch.float64), rtol=FP32_TOL["rtol"], atol=0)
    assert set(regional.params) == set(whole.params)
    for name, value in whole.params.items():
        torch.testing.assert_close(regional.params[name], value, **FP32_TOL, msg=lambda m: f"{name}: {m}")

    # (b) nothing gathered on demand at use: in the graphs every group goes ahead, and no eager
    # hook (the modules outside the layers) gathers a parameter that was not launched ahead.
    _every_group_ahead(whole_report)
    _every_group_ahead(report)
    assert whole_counts.eager_on_demand == 0 and counts.eager_on_demand == 0, tag

    # (a) launched ahead across units: the whole-model graph launches all but the head group of
    # its forward and of its backward ahead (its two cold unit starts per step); per-layer graphs
    # launch every unit's first gathers from the unit before it: the forward's first (the
    # embedding, and the first layer's first group) at the step's start, where the whole-model
    # graph launches its head group, the backward's first while the head's backward runs.
    assert whole_counts.cold_units == 2 * COUNTED_STEPS, tag
    assert whole_counts.cold_params > 0, tag
    assert counts.cold_units == 0 and counts.cold_params == 0, tag
    # Every layer's forward and backward, and the 3 eager modules' forward, start warm.
    assert counts.warm_params > 0 and counts.launched >= (2 * layers + 3) * COUNTED_STEPS, tag
    # On a CPU device without compile.memory_budget_bytes there is no budget to hold anything back.
    assert counts.held_back_for_memory == 0, tag


@pytest.mark.parametrize("world", [1, 2], ids=multiproc.ws_id)
def test_regional_prefetch_matches_whole_model(world):
    run_distributed(_parity_body, world, timeout=900)


def _persistent_body(ctx):
    """Selective unsharding decides per parameter over every instance of a shared layer graph (each
    instance is profiled with its own parameters), as the whole-model graph decides per parameter:
    with no budget (a CPU device), both keep every layer parameter gathered, not only the first
    instance's."""
    whole, _, whole_report, engine = _train(ctx, regional=False, selective=True)
    engine.destroy()
    regional, _, report, engine = _train(ctx, regional=True, selective=True)
    engine.destroy()
    torch.testing.assert_close(torch.tensor(regional.losses), torch.tensor(whole.losses), **FP32_TOL)
    chosen = {p["param"] for p in report["persistent"]}
    whole_chosen = {p["param"] for p in whole_report["persistent"]}
    layer_params = {n for n in whole.params if ".layers." in n}
    assert len(layer_params) == 4 * 9 and layer_params <= chosen, sorted(layer_params - chosen)
    assert {n for n in whole_chosen if ".layers." in n} == layer_params, sorted(whole_chosen)
    # Outside the layers the eager modules gather once per micro-step (autograd keeps the copy for
    # their backward), so keeping them gathered would save nothing at one micro-step per step.
    assert chosen == layer_params, sorted(chosen - layer_params)


@pytest.mark.parametrize("world", [1], ids=multiproc.ws_id)
def test_regional_persistence_covers_every_instance(world):
    run_distributed(_persistent_body, world, timeout=900)


# ---- the chain and the merged profile, without a runtime ----------------------------------------


class _Instance:
    def __init__(self, graph_id, template_graph_id):
        self.graph_id, self.template_graph_id = graph_id, template_graph_id

    def ds_ids(self, first_ids):
        return [100 * self.graph_id + i for i in first_ids]


def _chain_over(phase, units, monkeypatch):
    from deepcompile.scheduling import instance_chain

    launched = []
    monkeypatch.setattr(instance_chain, "_prefetch", lambda graph_id, ds_ids, dtypes: launched.append((graph_id, ds_ids)))
    chain = instance_chain.InstanceChain()
    chain.start_recording()
    for unit in units:
        chain.note(phase, unit)
    chain.stop_recording()
    chain.build(None, torch.device("cpu"))
    return chain, launched


def _plan(ds_id, nbytes, peak):
    gather = types.SimpleNamespace(ds_id=ds_id, dtype=torch.float32, numel=nbytes // 4)
    return types.SimpleNamespace(groups=[types.SimpleNamespace(gathers=[gather], nbytes=nbytes)],
                                 predicted_peak_bytes=peak, resident=frozenset(), peak_live_numel=0)


def test_chain_walks_past_eager_units_to_the_next_graph(monkeypatch):
    """The last layer starts: the final norm's and the head's parameters (eager, gathered at their
    start with no compute of their own before) and the next graph's first group are launched
    together; the budget stops the walk at the first unit that does not fit."""
    from deepcompile.scheduling.instance_chain import EagerUnit

    start = EagerUnit(-1, "step start")
    norm = EagerUnit(-2, "norm", [50], [10], dtypes=[torch.float32])  # 40 bytes
    head = EagerUnit(-3, "lm_head", [51], [100], dtypes=[torch.float32])  # 400 bytes
    layer, after = _Instance(2, 2), _Instance(7, 7)
    chain, launched = _chain_over("forward", [start, layer, norm, head, after], monkeypatch)
    chain.set_head("forward", 2, _plan(3, 80, peak=1000))
    chain.set_head("forward", 7, _plan(9, 40, peak=900))
    chain.set_profiled_peaks({("forward", 2): 1000, ("forward", 7): 900})
    chain.launch_after("forward", 2, 2)
    assert launched == [(0, [50]), (0, [51]), (7, [709])], launched
    # The step start walks nowhere past the layer: it is a graph.
    launched.clear()
    chain.launch_after("forward", -1, -1)
    assert launched == [(2, [203])], launched
    # Without the walk, only the next unit.
    chain.deep, chain._resolved = False, {}
    launched.clear()
    chain.launch_after("forward", 2, 2)
    assert launched == [(0, [50])], launched
    # A budget that holds the norm but not the head on top of the layer's peak of 1000.
    chain.deep, chain._resolved, chain.budget_bytes = True, {}, 1000 + 40 + 399
    launched.clear()
    chain.launch_after("forward", 2, 2)
    assert launched == [(0, [50])] and chain.held_back == 1, launched
    # In the backward an eager module gathers nothing (autograd holds its forward's copies).
    assert head.head("backward").ds_ids == [] and head.head("forward").nbytes == 400


def test_chain_fits_each_instance_on_its_own_peak(monkeypatch):
    """Two instances of one graph: the later layer was profiled at a higher peak, so what its
    start launches is held on top of that peak, not of the first instance's."""
    a, b, c = _Instance(2, 2), _Instance(3, 2), _Instance(4, 2)
    chain, launched = _chain_over("forward", [a, b, c], monkeypatch)
    chain.set_head("forward", 2, _plan(5, 100, peak=1050))  # planned: 50 bytes above the profile
    chain.set_profiled_peaks({("forward", 2): 1000, ("forward", 3): 1300})
    chain.budget_bytes = 1200
    chain.launch_after("forward", 2, 2)  # 1000 + 50 + 100 <= 1200
    chain.launch_after("forward", 3, 2)  # 1300 + 50 + 100 > 1200
    assert launched == [(3, [305])] and chain.held_back == 1, launched


def test_shared_graph_is_planned_from_every_instance_profile():
    """The plan of a graph several instances run comes from their profiles merged: per node the
    largest peak, so a group that goes ahead fits for every instance."""
    from deepcompile.profiling.graph_profiler import GraphProfile, NodeProfile
    from deepcompile.scheduling.instance_profiles import merged_profile

    def profile(graph_id, peaks, complete=True):
        return GraphProfile(graph_id, "forward", [NodeProfile(f"n{i}", "t", 1.0, 0, 0, p) for i, p in enumerate(peaks)],
                            complete=complete)

    first = profile(2, [10, 50, 20])
    merged = merged_profile(first, [profile(3, [30, 40, 25]), profile(4, [999, 999, 999], complete=False)])
    assert [n.peak_bytes for n in merged.nodes] == [30, 50, 25]
    assert merged.graph_id == 2 and [n.name for n in merged.nodes] == ["n0", "n1", "n2"]
    assert merged_profile(first, []) is first
