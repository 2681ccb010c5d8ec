"""Hybrid sharding (``zero_optimization.mics_shard_size``, ``initialize(shard_group_size=)``)
end to end: parity with single-process training and the bytes each link carries.

4 gloo ranks on CPU (or 4 GPUs), as 2 shard groups of 2 (2x2) and as one group of 4 (1x4, plain
ZeRO); on 2 GPUs (``DC_TEST_DEVICE=cuda``, the test marked ``gpu``) 2 ranks as 2x1 and 1x2. Parity compares losses, the
global gradient norm of every optimizer step (a replica all-reduce that sums instead of
averaging, or runs twice, is off by a factor there) and the final parameters, as every parity
suite does. The byte counts are the runtime's own (``engine.step_report.comm_bytes``), asserted
against what the sizes predict (docs/design/hybrid_sharding.md):

* replica link: per optimizer step, one all-reduce of each gradient partition (``ppr`` fp32
  elements per parameter under ZeRO-3; this rank's owned pieces under ZeRO-1/2), nothing else;
* shard link: reduce-scatters of the padded gradients, and gathers of the padded parameters of
  the shard group's size, so per-rank wire bytes of the gathers scale with ``(S - 1) / S`` of the
  full parameters instead of ``(W - 1) / W``; under ZeRO-1/2 the reduces to the owners and the
  stage's own all-gather of the updated partitions (torch.distributed, merged into the report).

The parity launch also runs fp16 dynamic loss scaling with an overflow on one rank of one
replica (``_fp16_overflow_body``): skipped on every rank, the same scale everywhere after it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import require_world_size, run_distributed
from _harness.parity_cases import GLOBAL_BATCH, assert_parity, batch, build_model, train_engine, train_reference
from _harness.poison_grad import PoisonGrad
from test_zero3_parity import FP32_TOL, INDUCTOR_TOL

CPU_WORLD = 4
TIMEOUT = 600


def _config(stage, shard, gas=1, **zero):
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "mics_shard_size": shard, **zero},
            "gradient_accumulation_steps": gas}


def _padded(numel, ranks):
    return -(-numel // ranks) * ranks


def _parity_body(ctx, cases):
    """Every case in one launch: (stage, shard size, backend, gradient accumulation steps[, the
    compile section of a feature run together with hybrid sharding])."""
    from deepcompile import runtime

    for stage, shard, backend, gas, *feature in cases:
        steps = 2 * gas if gas > 1 else 3
        config = _config(stage, shard, gas)
        if feature:
            config["compile"] = dict(feature[0])
        # ZeRO-3 eager: the profile-guided passes plan after 2 steps (their all-gather timing runs
        # over the shard group, agreed over the world), and train on with the plan.
        planned = stage == 3 and backend == "eager"
        if planned:
            config["compile"] = {**config.get("compile", {}), "warmup_steps": 2}
            steps = 4
        got, engine = train_engine("mlp", steps, config, backend, ctx.device)
        ref = train_reference("mlp", steps, gas=gas, device=ctx.device)
        case = f"ZeRO-{stage} {ctx.world_size // shard}x{shard} {backend} gas {gas}" + (f" {feature[0]}" if feature else "")
        try:
            assert_parity(got, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
        # Partitioned over the shard group only; a replica link exactly when there are replicas.
        assert runtime.world_size() == shard, case
        topology = engine.topology
        if shard < ctx.world_size:  # shard groups of consecutive ranks, replicas at a stride of S
            first = ctx.rank // shard * shard
            assert dist.get_process_group_ranks(topology.shard_group) == list(range(first, first + shard)), case
            assert dist.get_process_group_ranks(topology.replica_group) == \
                list(range(ctx.rank % shard, ctx.world_size, shard)), case
        else:
            assert topology.shard_group is dist.group.WORLD and topology.replica_group is None, case
        if planned:
            assert engine.schedule_report()["graphs"], f"{case}: the profile-guided passes did not run"
        if feature:  # the feature was on, not only configured
            wanted = "backward_step" if "optimizer_step_in_backward" in feature[0] else "optimizer_state_offload"
            assert any(p.name == wanted for p in engine.parts), (case, [p.name for p in engine.parts])
        links = engine.step_report.comm_bytes
        assert set(links) == ({"shard", "replica"} if shard < ctx.world_size else {"shard"}), (case, links)
        engine.destroy()


def _parity_cases(world):
    shard = world // 2
    # Plain 1xW training has its parity suites (test_world_sizes.py); the bytes test runs it here.
    cases = [(3, shard, "eager", 1), (3, shard, "inductor", 1)]
    cases += [(stage, shard, "eager", 2) for stage in (1, 2)]
    cases += [(2, shard, "inductor", 1)]
    # Features combine: hybrid sharding with optimizer-state and parameter offload under gradient
    # accumulation (host copies of shard-group partitions, stepped after the replica all-reduce),
    # and with the optimizer step in the backward (each parameter's step right after its replica
    # all-reduce, before the flush that ends the backward).
    cases += [(3, shard, "eager", 2, {"offload_opt_states": True, "offload_parameters": True}),
              (3, shard, "eager", 1, {"optimizer_step_in_backward": True})]
    return cases


# ---- fp16 loss scaling ---------------------------------------------------------------------------
# Configured as tests/precision/test_fp16_training.py's overflow cases: a dynamic scale from 2**8
# that the first overflow halves. SGD with momentum, whose update is proportional to the gradient
# (under Adam a scale left in the gradients would go unseen).

FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
INITIAL_SCALE = 2.0 ** 8
FP16_STEPS, POISONED_STEP = 4, 1
POISONED_RANK = 1  # one rank of the first shard group: only its gradients overflow
# Hybrid against plain: each rank computes the same fp16 forward and backward on the same slice;
# only the reduction's grouping differs ((S ranks) then (R replicas) against all W at once), in
# the reduce dtype (fp16 for ZeRO-1/2), i.e. about 1e-3 relative on a gradient element. Over 3
# applied SGD steps of lr 0.05 that moves the fp32 masters by well under 1e-4, and the fp16
# parameters compared may round one unit in the last place apart (4.9e-4 for |p| < 1): atol 1e-3,
# as test_fp16_training's parity. A gradient off by a factor (a replica all-reduce summing instead
# of averaging, a scale not divided out) moves a parameter by a few 1e-3 in the first step.
FP16_TOL = dict(rtol=2e-3, atol=1e-3)


def _fp16_run(ctx, stage, shard):
    """fp16 training where POISONED_RANK's gradients alone overflow at POISONED_STEP. Per
    optimizer step: every rank's (overflow, cur_scale, the scaler's scale, skipped steps), the
    global norm, the full fp16 parameters and this rank's fp32 master pieces."""
    import deepcompile

    torch._dynamo.reset()
    model = build_model("mlp", device=ctx.device)
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // ctx.world_size, "fp16": FP16,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "mics_shard_size": shard}}
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), config,
                                    device=ctx.device)
    assert engine.topology.hybrid == (shard < ctx.world_size) and engine.loss_scaler.loss_scale == INITIAL_SCALE
    current = {"step": 0}
    if ctx.rank == POISONED_RANK:
        model.fc1.register_forward_hook(
            lambda m, i, out: PoisonGrad.apply(out) if current["step"] == POISONED_STEP else out)
    n = GLOBAL_BATCH // ctx.world_size
    steps = []
    for k in range(FP16_STEPS):
        current["step"] = k
        x, y = batch("mlp", k, device=ctx.device, dtype=torch.float16)
        engine.backward(engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n]))
        engine.step()
        flags = [None] * ctx.world_size
        dist.all_gather_object(flags, (engine.optimizer.overflow, engine.optimizer.cur_scale,
                                       engine.loss_scaler.loss_scale, engine.skipped_steps))
        steps.append({"flags": flags, "norm": engine.get_global_grad_norm(),
                      "params": engine.full_state_dict(all_ranks=True),
                      "masters": [s.local.detach().cpu().clone() for s in engine.sharding.shards()]})
    engine.destroy()
    return steps


def _fp16_overflow_body(ctx):
    """The overflow vote is over the world under hybrid sharding: the inf of one rank of one
    replica reaches the other replica through the gradient partitions' all-reduce, so every rank
    skips the same step and lowers its scale alike; the other steps are in parity with plain
    ZeRO over the world, which skips the same step."""
    shard = ctx.world_size // 2
    for stage in (2, 3):
        hybrid, plain = _fp16_run(ctx, stage, shard), _fp16_run(ctx, stage, ctx.world_size)
        for k, (h, p) in enumerate(zip(hybrid, plain)):
            case = f"fp16 ZeRO-{stage} {ctx.world_size // shard}x{shard}, step {k}"
            scale = INITIAL_SCALE / 2 if k >= POISONED_STEP else INITIAL_SCALE  # the scale after step k
            want = (k == POISONED_STEP, scale, scale, int(k >= POISONED_STEP))
            assert h["flags"] == [want] * ctx.world_size, (case, h["flags"])
            assert p["flags"] == h["flags"], (case, p["flags"])
            # The replicas hold the same model, bit for bit.
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, h["params"])
            for other in everyone:
                assert all(torch.equal(other[name], h["params"][name]) for name in h["params"]), case
            if k == POISONED_STEP:
                assert not math.isfinite(h["norm"]) and not math.isfinite(p["norm"]), case
                # Nothing moved: the state is the one after step k - 1, when nothing had yet told
                # this run from a clean one (fp16 parameters and fp32 masters, bitwise).
                before = hybrid[k - 1]
                assert all(torch.equal(h["params"][name], before["params"][name]) for name in h["params"]), case
                assert all(torch.equal(a, b) for a, b in zip(h["masters"], before["masters"])), case
                continue
            assert math.isclose(h["norm"], p["norm"], rel_tol=FP16_TOL["rtol"]), (case, h["norm"], p["norm"])
            for name in p["params"]:
                torch.testing.assert_close(h["params"][name].float(), p["params"][name].float(), **FP16_TOL,
                                           msg=lambda m: f"{case}, {name}: {m}")
        # Training went on after the skipped step.
        assert any(not torch.equal(hybrid[-1]["params"][name], hybrid[POISONED_STEP]["params"][name])
                   for name in hybrid[-1]["params"])


def _parity_and_fp16_body(ctx, cases):
    _parity_body(ctx, cases)
    _fp16_overflow_body(ctx)  # in the same launch: one set of 4 processes for both


@pytest.mark.world_size(CPU_WORLD)
def test_hybrid_parity_zero123_eager_and_inductor():
    """The cases of _parity_cases, then fp16 loss scaling with an overflow on one rank of one
    replica (_fp16_overflow_body), in one launch."""
    require_world_size(CPU_WORLD)  # on GPUs: 4 of them (2 GPUs: test_hybrid_parity_on_two_gpus)
    run_distributed(_parity_and_fp16_body, CPU_WORLD, args=(_parity_cases(CPU_WORLD),), timeout=TIMEOUT)


@pytest.mark.gpu
@pytest.mark.world_size(2)
def test_hybrid_parity_on_two_gpus():
    """2 GPUs as 2x1 (replicas of one rank each: every gradient crosses only the replica link)
    and 1x2 (plain)."""
    require_world_size(2)
    cases = [(3, 1, "eager", 1), (3, 1, "inductor", 1), (3, 2, "eager", 1), (1, 1, "eager", 2), (2, 1, "eager", 2)]
    run_distributed(_parity_and_fp16_body, 2, args=(cases,), timeout=TIMEOUT)
    run_distributed(_bytes_body, 2, timeout=TIMEOUT)


# ---- counted bytes ----------------------------------------------------------------------------------


def _zero3_step_bytes(ctx, shard):
    """The runtime's counts of the last of three ZeRO-3 steps, every parameter persistent (so each
    is gathered exactly once per step, after the update invalidated it), and the predictions."""
    got, engine = train_engine("mlp", 3, _config(3, shard, stage3_param_persistence_threshold=10**6), "eager",
                               ctx.device)
    counted = engine.step_report.comm_bytes
    engine.destroy()
    sizes = [p.numel() for p in build_model("mlp").parameters()]
    fp32 = 4
    predicted = {"shard": {"ranks": shard, "all_gather": fp32 * sum(_padded(n, shard) for n in sizes),
                           "reduce_scatter": fp32 * sum(_padded(n, shard) for n in sizes),
                           "reduce": 0, "all_reduce": 0}}
    replicas = ctx.world_size // shard
    if replicas > 1:
        predicted["replica"] = {"ranks": replicas, "all_gather": 0, "reduce_scatter": 0, "reduce": 0,
                                "all_reduce": fp32 * sum(_padded(n, shard) // shard for n in sizes)}
    return counted, predicted


def _zero12_step_bytes(ctx, stage, shard, gas):
    """ZeRO-1/2, the last of two optimizer steps: on the shard link one reduce per owned range of
    every gradient per reduction (ZeRO-2: every micro-step; ZeRO-1: once per window) and the
    all-gather of the updated partitions (zero/stage12.py, fp32 on gloo: the whole padded flat
    group), this rank's owned pieces all-reduced on the replica link per reduction."""
    got, engine = train_engine("mlp", 2 * gas, _config(stage, shard, gas), "eager", ctx.device)
    counted = engine.step_report.comm_bytes
    owned = sum(s.end - s.start for s in engine.sharding.shards())
    engine.destroy()
    numel = sum(p.numel() for p in build_model("mlp").parameters())  # one param group
    reductions = gas if stage == 2 else 1
    return counted, reductions * 4 * numel, reductions * 4 * owned, 4 * _padded(numel, shard)


def _without_wire(link):
    return {k: v for k, v in link.items() if k != "wire"}


def _bytes_body(ctx):
    world = ctx.world_size
    hybrid = world // 2
    hybrid_counts, hybrid_predicted = _zero3_step_bytes(ctx, hybrid)
    plain_counts, plain_predicted = _zero3_step_bytes(ctx, world)
    for counted, predicted in ((hybrid_counts, hybrid_predicted), (plain_counts, plain_predicted)):
        assert {k: _without_wire(v) for k, v in counted.items()} == predicted, (counted, predicted)
    # Wire bytes per rank (ring algorithms): the gathers and reduce-scatters cross (S-1)/S of their
    # payload, the replica all-reduce 2(R-1)/R. The shard link's gather traffic falls from
    # (W-1)/W to (S-1)/S of the padded parameters.
    for counted in (hybrid_counts, plain_counts):
        for link in counted.values():
            n = link["ranks"]
            expected = (n - 1) / n * (link["all_gather"] + link["reduce_scatter"] + link["reduce"]) \
                + 2 * (n - 1) / n * link["all_reduce"]
            assert link["wire"] == round(expected), counted
    gather_factor = (hybrid_counts["shard"]["all_gather"] * (hybrid - 1) / hybrid) / \
        (plain_counts["shard"]["all_gather"] * (world - 1) / world)
    sizes = [p.numel() for p in build_model("mlp").parameters()]
    predicted_factor = (sum(_padded(n, hybrid) for n in sizes) * (hybrid - 1) / hybrid) / \
        (sum(_padded(n, world) for n in sizes) * (world - 1) / world)
    assert gather_factor == pytest.approx(predicted_factor, rel=1e-12)
    # Nothing but the gradient partitions' all-reduce crosses between replicas.
    replica = hybrid_counts["replica"]
    assert replica["all_gather"] == replica["reduce_scatter"] == replica["reduce"] == 0 and replica["all_reduce"] > 0

    for stage, gas in ((2, 1), (1, 2)):
        counted, reduced, owned, gathered = _zero12_step_bytes(ctx, stage, hybrid, gas)
        assert _without_wire(counted["shard"]) == {"ranks": hybrid, "all_gather": gathered, "reduce_scatter": 0,
                                                   "reduce": reduced, "all_reduce": 0}, (stage, counted)
        assert _without_wire(counted["replica"]) == {"ranks": world // hybrid, "all_gather": 0, "reduce_scatter": 0,
                                                     "reduce": 0, "all_reduce": owned}, (stage, counted)
        # The wire bytes include the all-gather's: (S-1)/S of it, rounded once with the rest.
        shard, replica = counted["shard"], counted["replica"]
        assert shard["wire"] == round((hybrid - 1) / hybrid * (gathered + reduced)), (stage, counted)
        assert replica["wire"] == round(2 * (world // hybrid - 1) / (world // hybrid) * owned), (stage, counted)
    _modifier_rank_reaches_every_replica(ctx, hybrid)


def _modifier_rank_reaches_every_replica(ctx, shard):
    """GatheredParameters(modifier_rank=0) writes global rank 0's values into every shard group,
    not each group's first rank's (a replica that took its own would train another model)."""
    from deepcompile.zero.gathered_params import Gathered

    _, engine = train_engine("mlp", 1, _config(3, shard), None, ctx.device)
    bias = engine.module.fc2.bias
    with Gathered([bias], modifier_rank=0):
        bias.data.fill_(float(ctx.rank + 1))
    state = engine.full_state_dict(all_ranks=True)
    engine.destroy()
    assert torch.equal(state["fc2.bias"], torch.ones(5)), state["fc2.bias"]


@pytest.mark.world_size(CPU_WORLD)
def test_hybrid_bytes_per_link_match_the_prediction():
    require_world_size(CPU_WORLD)  # on GPUs: 4 of them (2 GPUs: test_hybrid_parity_on_two_gpus)
    run_distributed(_bytes_body, CPU_WORLD, timeout=TIMEOUT)
