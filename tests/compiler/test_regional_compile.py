"""Regional compilation (engine.compile(regional=...)): each decoder layer compiled on its own,
identical layers sharing one compiled graph, the rest of the model eager.

Parity: the same training as single-process on the same global batch, through ZeRO-1/2/3 with the
default pass schedule (ZeRO-3 profiles the shared graph once per layer instance, then prefetches
and keeps parameters persistent from the plan). Tolerances as in the other parity suites: fp32
eager 1e-5 relative; Inductor 1e-4 (its fused kernels sum in another order than the eager
reference), which a missing, doubled or misrouted layer gradient exceeds by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _harness import multiproc
from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import assert_parity, train_engine, train_reference

WORLD = single_world_size()
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
TOL = {"eager": dict(rtol=1e-5, atol=1e-6), "inductor": dict(rtol=1e-4, atol=1e-5)}


def _config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 64}
    config = {"zero_optimization": zero, "gradient_accumulation_steps": 1}
    if stage == 3:
        # Nothing persistent: every layer gathers through the shared graph's slot ops, and from
        # step 1 on prefetches by the plan made from step 0's profiles of each instance.
        zero["stage3_param_persistence_threshold"] = 0
        config["compile"] = {"warmup_steps": 1, "selective_gather": False}
    return config


def _experts_traceable() -> bool:
    """Whether aot_autograd can trace transformers' MoE expert kernel (the grouped_mm fallback that
    fp32 under torch.compile uses) through its backward: only where that backward is a custom op of
    its own (transformers::grouped_mm_fallback_backward, transformers 5.2x; 5.17 has not). Before,
    its backward calls offs.tolist(), the graph fails to compile, and the experts run as leaves,
    splitting each layer into several shared graphs."""
    import transformers.integrations.moe  # noqa: F401  (registers the ops)

    return hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")


def _body(ctx, name, backend, stage, steps, optimizer="adamw"):
    got, engine = train_engine(name, steps, _config(stage), backend, ctx.device, regional=True, optimizer=optimizer)
    ref = train_reference(name, steps, device=ctx.device, optimizer=optimizer)
    assert_parity(got, ref, **TOL[backend])
    backend_obj = engine.compiled_module.backend_for(backend)
    layers = engine.module.model.model.layers
    # The layers share their compiled graphs: one capture per distinct layer signature, and every
    # layer runs as an instance of its own (its own ds ids, in slot order).
    slot_sets = {tuple(i.slot_ids) for i in backend_obj.instances.values()}
    # No layer after the first compiled a graph of its own: every compiled graph was captured
    # with the first layer's parameters (or none), the later layers run as its instances.
    ds_id_of = backend_obj._ds_id_of
    later = {ds_id_of[id(p)] for layer in layers[1:] for p in layer.parameters()}
    own = [r.graph_id for r in backend_obj.graphs if later & set(r.slot_ids)]
    assert not own, f"graphs {own} were compiled for a layer after the first"
    assert len(slot_sets) == len(backend_obj.instances)
    first_ids = {tuple(i.slot_ids) for i in backend_obj.instances.values() if i.graph_id in
                 {r.graph_id for r in backend_obj.graphs}}
    shared = set(slot_sets) - first_ids
    assert shared, "no layer ran as another instance of a shared graph"
    if stage == 3:
        driver = engine.scheduler
        assert "prefetch" in driver.applied.passes
        profiled = [sig for sig in driver.profiles if sig[0] == "forward"]
        assert len(profiled) == len(backend_obj.instances), "every layer instance is profiled once"
        # Prefetch across layers: each layer, forward and backward, starts the next one's first group.
        assert {phase for phase, _ in driver.chain.links} == {"forward", "backward"}, driver.chain.links
        assert driver.chain.launched > 0
        across = engine.schedule_report()["prefetch_across_graphs"]
        assert across["links"] == len(driver.chain.links) and across["launched"] == driver.chain.launched
        assert across["held_back_for_memory"] == 0  # a CPU device without memory_budget_bytes has no budget
        assert "prefetch across graphs:" in engine.scheduler.report.text()
        # Parameters outside the layers (embedding, final norm, head) run eagerly, gathered by the hooks.
        eager = engine.eagerly_gathered_params()
        leaves = () if _experts_traceable() else (".mlp.experts.",)
        assert eager and not any(".layers." in n and not any(leaf in n for leaf in leaves) for n in eager), eager
    engine.destroy()


@pytest.mark.parametrize("stage", [3, 2, 1])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_regional_llama_parity(backend, stage):
    run_distributed(_body, WORLD, args=("llama", backend, stage, 4), timeout=900)


def test_regional_llama_zero3_sgd_momentum():
    """Per-layer graphs under SGD with momentum, whose update scales with the gradient: a layer
    gradient reduced twice or left unaveraged through the shared graph moves its parameters by
    the wrong amount (AdamW's normalised update would hide it; the norms catch it too)."""
    run_distributed(_body, WORLD, args=("llama", "eager", 3, 4), kwargs={"optimizer": "sgd_momentum"}, timeout=900)


def test_regional_qwen2_moe_zero3():
    """Qwen2-MoE's decoder layers compiled one by one (ZeRO-3, Inductor): the expert kernel's
    custom op and the shared graph together."""
    run_distributed(_body, WORLD, args=("qwen2_moe", "inductor", 3, 3), timeout=900)


def _offload_run(ctx, steps, budget):
    """Regional ZeRO-3 Llama (eager backend) with activation offload under ``budget`` bytes (None:
    no budget, on a CPU device everything is offloaded); returns the run, the per-step bytes the
    offload ops kept on the device, and the engine."""
    import deepcompile
    from _harness.parity_cases import build_model, make_optimizer, run_steps

    torch._dynamo.reset()
    config = _config(3)
    config["compile"] = {**config["compile"], "offload_activation": True, "memory_budget_bytes": budget}
    model = build_model("llama", device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), config)
    engine.compile(backend="eager", regional=True)
    kept, last = [], {}

    def after_step(engine, step):
        stats = engine.activations.offloader.stats
        kept.append(sum((s.kept - last.get(s.key, 0)) * s.nbytes for s in stats.values()))
        last.update({s.key: s.kept for s in stats.values()})

    return run_steps(engine, "llama", steps, ctx.device, after_step=after_step), kept, engine


def _offload_body(ctx, steps=4):
    """The layers' offload sites run once per layer instance: the plan weighs every instance of a
    site (it keeps or moves them together), so what it keeps on the device stays in the budget.
    It once weighed one tensor per site: with 2 layers sharing the graph, the plan thought that
    everything fitted in half of its real size and kept all of it."""
    from _harness.parity_cases import train_reference

    _, _, engine = _offload_run(ctx, steps, None)
    stats = [s for s in engine.activations.offloader.stats.values() if s.offloads > 0]
    layers = len(engine.module.model.model.layers)
    assert stats and all(s.runs_per_micro_step == layers for s in stats), \
        [(s.name, s.runs_per_micro_step) for s in stats]
    # Where each run sits in the forward (the joint plan's positions): every key's run in the
    # first layer comes before its run in the second.
    positions = engine.activations.offloader.positions
    assert all(positions[(s.key, 0)] < positions[(s.key, 1)] for s in stats), positions
    total = sum(s.bytes_per_micro_step for s in stats)
    assert engine.schedule_report()["activations"]["offloaded_bytes"] == total
    smallest = min(s.nbytes for s in stats)
    engine.destroy()

    # A CPU device reads no memory (the floor is 0): the budget is what may stay resident. Half
    # of the tensors plus one: a whole key's runs offloaded would be one tensor more than needed.
    budget = total // 2 + smallest
    got, kept, engine = _offload_run(ctx, steps, budget)
    report = engine.schedule_report()["activations"]
    assert report["planned_after_step"] == 1, report
    assert 0 < report["resident_bytes"] <= budget < report["resident_bytes"] + report["offloaded_bytes"], report
    # The plan decides run by run: it offloads no more than one tensor beyond what the budget
    # requires (a decision per key would move both layers' tensors of a key together).
    largest = max(t["tensor_bytes"] for t in report["tensors"])
    assert report["resident_bytes"] > budget - largest, report
    assert any(0 < t["offloaded_bytes"] < t["bytes"] for t in report["tensors"]), report["tensors"]
    # From the step after the plan, the ops keep exactly what the report says, within the budget.
    assert kept[2:] == [report["resident_bytes"]] * (steps - 2), (kept, report)
    engine.destroy()
    assert_parity(got, train_reference("llama", steps, device=ctx.device), **TOL["eager"])


@pytest.mark.skipif(multiproc.test_device_type() == "cuda",
                    reason="the tiny Llama's activations are below the 1 MiB a CUDA offload candidate needs "
                           "(offload/activations.py); the planning it checks does not depend on the device")
def test_regional_activation_offload_plans_every_instance():
    run_distributed(_offload_body, WORLD, timeout=900)


def test_regional_needs_blocks():
    from deepcompile.compiler.regions import find_regions

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match="_no_split_modules"):
        find_regions(model, True)
    with pytest.raises(ValueError, match="found no module"):
        find_regions(model, ["LlamaDecoderLayer"])
    with pytest.raises(ValueError, match="module classes or class names"):
        find_regions(model, [3])
    assert find_regions(model, [nn.Linear]) == [model[0]]
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    # A block inside another block is compiled as part of it.
    assert find_regions(nested, ["Sequential"]) == [nested]


def _dynamic_body(ctx, backend):
    """Sequence lengths change every step under dynamic=True: the shared layer graph has symbolic
    sizes, so a plan switch recompiles the blocks with a fresh backend (no in-place re-plan)."""
    import torch.distributed as dist

    import deepcompile
    from _harness.parity_cases import GLOBAL_BATCH, build_model, make_optimizer

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference = build_model("llama", device=ctx.device), build_model("llama", device=ctx.device)
    config = _config(3)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), config)
    engine.compile(backend=backend, regional=True, dynamic=True)
    ref_opt = make_optimizer(reference.parameters())
    n = GLOBAL_BATCH // world
    for step, length in enumerate([8, 11, 6, 13]):
        tokens = torch.randint(0, 61, (GLOBAL_BATCH, length), generator=torch.Generator().manual_seed(step))
        tokens = tokens.to(ctx.device)
        mine = tokens[rank * n:(rank + 1) * n]
        loss = engine(mine, mine)
        engine.backward(loss)
        engine.step()
        ref_loss = reference(tokens, tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total.item() / world, ref_loss.item(), **TOL[backend])
    state = engine.full_state_dict(all_ranks=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value.detach().float().cpu(), **TOL[backend],
                                   msg=lambda m: f"{name}: {m}")
    engine.destroy()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_regional_variable_lengths(backend):
    run_distributed(_dynamic_body, WORLD, args=(backend,), timeout=900)


class _Instance:
    def __init__(self, graph_id, template_graph_id):
        self.graph_id, self.template_graph_id = graph_id, template_graph_id

    def ds_ids(self, first_ids):
        return [100 * self.graph_id + i for i in first_ids]


def test_instance_chain_links_only_unambiguous_successors():
    from deepcompile.scheduling.instance_chain import InstanceChain

    embed, a, b, c, head = _Instance(1, 1), _Instance(2, 2), _Instance(3, 2), _Instance(4, 2), _Instance(5, 5)
    chain = InstanceChain()
    chain.note("forward", a)  # not recording yet: ignored
    chain.start_recording()
    for instance in (embed, a, b, c, head):
        chain.note("forward", instance)
    for instance in (c, b, a, b, c):  # b is followed by a, then by c: no link from b
        chain.note("backward", instance)
    chain.stop_recording()
    chain.build(None, torch.device("cpu"))
    links = {key: v.graph_id for key, v in chain.links.items()}
    # Every unambiguous successor is linked, of a shared graph (a, b, c) or not (embed, head): the
    # first layer's graph is often one of its own (its input does not require grad).
    assert links == {("forward", 1): 2, ("forward", 2): 3, ("forward", 3): 4, ("forward", 4): 5,
                     ("backward", 4): 3, ("backward", 2): 3}, links
    chain.clear()
    assert not chain.links


def test_instance_chain_launches_only_what_fits_the_budget(monkeypatch):
    """The next layer's first group is held through the current layer's run: a link is used only
    while the current plan's predicted peak plus that group stays within the budget."""
    from types import SimpleNamespace

    from deepcompile.scheduling import instance_chain
    from deepcompile.scheduling.instance_chain import InstanceChain

    launched = []
    monkeypatch.setattr(instance_chain, "_prefetch", lambda graph_id, ds_ids, dtypes: launched.append((graph_id, ds_ids)))
    a, b = _Instance(2, 2), _Instance(3, 2)
    chain = InstanceChain()
    chain.start_recording()
    for instance in (a, b):
        chain.note("forward", instance)
    chain.stop_recording()
    chain.build(None, torch.device("cpu"))
    gather = SimpleNamespace(ds_id=7, dtype=torch.bfloat16, numel=150)
    plan = SimpleNamespace(groups=[SimpleNamespace(gathers=[gather], nbytes=300)], predicted_peak_bytes=1000,
                           resident=frozenset(), peak_live_numel=50)
    chain.set_head("forward", 2, plan)
    chain.budget_bytes = 1300  # 1000 + 300: fits exactly
    chain.launch_after("forward", 2, 2)
    assert launched == [(3, [307])] and chain.held_back == 0
    chain.budget_bytes = 1299
    chain.set_head("forward", 2, plan)  # a new plan: the decision is made again
    chain.launch_after("forward", 2, 2)
    assert len(launched) == 1 and chain.held_back == 1 and chain.launched == 1
    # No budget: always; a budget but no predicted peak (no profile): never.
    chain.budget_bytes = None
    chain.set_head("forward", 2, plan)
    chain.launch_after("forward", 2, 2)
    assert len(launched) == 2
    chain.budget_bytes = 10**9
    chain.set_head("forward", 2, SimpleNamespace(groups=plan.groups, predicted_peak_bytes=None,
                                                 resident=frozenset(), peak_live_numel=50))
    chain.launch_after("forward", 2, 2)
    assert len(launched) == 2 and chain.held_back == 2
    # stage3_max_live_parameters: the 50 elements the current plan holds plus the group's 150.
    chain.budget_bytes = None
    chain.max_live_numel = 199
    chain.set_head("forward", 2, plan)
    chain.launch_after("forward", 2, 2)
    assert len(launched) == 2 and chain.held_back == 3
    chain.max_live_numel = 200
    chain.set_head("forward", 2, plan)
    chain.launch_after("forward", 2, 2)
    assert len(launched) == 3
