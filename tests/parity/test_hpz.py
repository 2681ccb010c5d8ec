"""hpZ (``zero_optimization.zero_hpz_partition_size``): ZeRO-3 over the whole world plus a secondary
copy of every parameter that is not persistent, sharded over groups of ``H`` consecutive ranks
(docs/design/hpz.md). The first gather of a parameter after an optimizer step reads the primary
shards over the world and leaves this rank's chunk of the secondary group behind; every later
gather until the next step (the backward's, further micro-steps' forwards) reads the secondary
copies within the group.

4 gloo ranks on CPU as hpZ 2 (two secondary groups of 2); on 2 GPUs (``DC_TEST_DEVICE=cuda``, the
test marked ``gpu``) hpZ 2, the secondary group being both GPUs over a second NCCL communicator.
Every case asserts:

* parity with single-process training (losses, per-step gradient norms, final parameters), and
  *bitwise* equality with plain ZeRO-3 on the same ranks: a secondary copy holds exactly the
  gathered values, so nothing may differ (a stale copy read after a step would);
* the secondary copies exist (their bytes, from the sizes) and were read (bytes on the secondary
  link);
* the bytes per link of one optimizer step: the world link's gathers fall to one gather per
  parameter and step, the rest moves to the secondary link, and the two add up to plain ZeRO-3's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import require_world_size, run_distributed
from _harness.parity_cases import assert_parity, build_model, train_engine, train_reference
from test_zero3_parity import FP32_TOL, INDUCTOR_TOL

CPU_WORLD = 4
TIMEOUT = 600


def _config(hpz, gas=1, compile_section=None):
    # Persistence threshold 0: every parameter is released after its uses and so has a secondary copy.
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "zero_hpz_partition_size": hpz,
                                    "stage3_param_persistence_threshold": 0},
              "gradient_accumulation_steps": gas}
    if compile_section:
        config["compile"] = dict(compile_section)
    return config


def _padded(numel, ranks):
    return -(-numel // ranks) * ranks


def _parity_body(ctx, hpz, cases):
    from deepcompile import runtime

    for backend, gas, feature in cases:
        steps = 2 * gas if gas > 1 else 3
        case = f"hpZ {hpz} {backend} gas {gas} {feature or ''}"
        got, engine = train_engine("mlp", steps, _config(hpz, gas, feature), backend, ctx.device)
        assert runtime.secondary_size() == hpz, case
        first = ctx.rank // hpz * hpz
        assert dist.get_process_group_ranks(engine.topology.secondary_group) == list(range(first, first + hpz)), case
        # Persistent parameters (the planner's selective unsharding may choose all of them on this
        # tiny model) stay gathered between steps and hold no secondary copy.
        sizes = dict(build_model("mlp").named_parameters())
        released = [n for i, n in engine.sharding.param_names().items() if not runtime.is_persistent(i)]
        assert runtime.secondary_bytes() == sum(4 * _padded(sizes[n].numel(), ctx.world_size) // hpz
                                                for n in released), case
        # Exactly one gather per parameter and step crosses the world link, whatever the plan; the
        # others read the copies (unplanned, fc2.weight is released after the forward and gathered
        # again by the backward).
        links = engine.step_report.comm_bytes
        assert set(links) == {"shard", "secondary"}, (case, links)
        assert links["shard"]["all_gather"] == sum(4 * _padded(p.numel(), ctx.world_size) for p in sizes.values()), \
            (case, links)
        if not (feature and "warmup_steps" in feature) or gas > 1:
            assert links["secondary"]["all_gather"] > 0, (case, released, links)
        # The schedule report names the link and shows what the copies hold.
        report = engine.schedule_report()
        secondary = report["links"]["secondary"]
        assert secondary["ranks"] == hpz and secondary["secondary_copy_bytes"] == runtime.secondary_bytes(), \
            (case, report.get("links"))
        assert "secondary" in report.to_text(), case
        wanted = ["backward_step"] if feature and "optimizer_step_in_backward" in feature else \
            ["optimizer_state_offload"] if feature and "offload_opt_states" in feature else []
        for name in wanted:  # the feature was on, not only configured
            assert any(p.name == name for p in engine.parts), (case, [p.name for p in engine.parts])
        if feature and "warmup_steps" in feature:
            assert report["graphs"], f"{case}: the profile-guided passes did not run"
        engine.destroy()

        plain, engine = train_engine("mlp", steps, _config(1, gas, feature), backend, ctx.device)
        engine.destroy()
        ref = train_reference("mlp", steps, gas=gas, device=ctx.device)
        try:
            assert_parity(got, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))
            assert got.losses == plain.losses and got.grad_norms == plain.grad_norms
            for name, value in plain.params.items():
                assert torch.equal(got.params[name], value), f"{name} differs from plain ZeRO-3"
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None


def _step_gather_bytes(ctx, hpz, gas):
    """The last optimizer step's bytes per link of an eager run (no prefetch plan: every gather
    is at its use)."""
    _, engine = train_engine("mlp", 2 * gas, _config(hpz, gas), "eager", ctx.device)
    counted = engine.step_report.comm_bytes
    engine.destroy()
    return counted


def _bytes_body(ctx, hpz):
    world = ctx.world_size
    padded = sum(4 * _padded(p.numel(), world) for p in build_model("mlp").parameters())
    per_gas = {}
    for gas in (1, 2):
        plain = _step_gather_bytes(ctx, 1, gas)
        hp = _step_gather_bytes(ctx, hpz, gas)
        # One gather per parameter and step crosses the world link: the first after the step.
        assert hp["shard"]["all_gather"] == padded, (gas, hp)
        # The others are the same gathers as plain ZeRO-3's, read within the secondary group.
        assert hp["shard"]["all_gather"] + hp["secondary"]["all_gather"] == plain["shard"]["all_gather"], (gas, hp, plain)
        assert hp["secondary"]["ranks"] == hpz and hp["shard"]["ranks"] == world
        # Gradients are reduced as before, and nothing else uses the secondary link.
        assert hp["shard"]["reduce_scatter"] == plain["shard"]["reduce_scatter"] > 0
        assert hp["secondary"]["reduce_scatter"] == hp["secondary"]["reduce"] == hp["secondary"]["all_reduce"] == 0
        for link in hp.values():
            n = link["ranks"]
            assert link["wire"] == round((n - 1) / n * (link["all_gather"] + link["reduce_scatter"])), hp
        per_gas[gas] = plain["shard"]["all_gather"]
    # What the design predicts (docs/design/hpz.md): plain ZeRO-3's world-link gathers grow with
    # the micro-steps (each forward gathers every parameter, each backward those it reads again),
    # hpZ's stay at one gather per parameter and step (asserted above for both): the world link's
    # gather bytes fall by the gathers per parameter and step, here (1 + backward share) * gas.
    assert per_gas[2] == 2 * per_gas[1] > 2 * padded, per_gas


def _checkpoint_body(ctx, hpz, directory):
    """Saved under hpZ, loaded by plain ZeRO-3 (the checkpoint holds the primary layout only)."""
    got, engine = train_engine("mlp", 2, _config(hpz), "eager", ctx.device)
    engine.save_checkpoint(directory)
    saved = engine.full_state_dict(all_ranks=True)
    engine.destroy()
    _, engine = train_engine("mlp", 0, _config(1), "eager", ctx.device)
    engine.load_checkpoint(directory)
    loaded = engine.full_state_dict(all_ranks=True)
    engine.destroy()
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def _cpu_body(ctx, directory):
    hpz = 2
    cases = [("eager", 1, None), ("inductor", 1, None), ("eager", 2, None),
             # Features combine: the profile-guided passes (prefetch, selective unsharding: a
             # parameter made persistent drops its copy), parameter and optimizer-state offload
             # under accumulation (the secondary copy spares the host reload), the step in the
             # backward (shards change before engine.step(): the copies must not outlive them).
             ("eager", 1, {"warmup_steps": 2}),
             ("eager", 2, {"offload_opt_states": True, "offload_parameters": True}),
             ("eager", 1, {"optimizer_step_in_backward": True, "warmup_steps": 1, "selective_gather": False})]
    _parity_body(ctx, hpz, cases)
    _bytes_body(ctx, hpz)
    _checkpoint_body(ctx, hpz, directory)


@pytest.mark.world_size(CPU_WORLD)
def test_hpz_parity_bytes_and_checkpoint(tmp_path):
    require_world_size(CPU_WORLD)  # on GPUs: 4 of them (2 GPUs: test_hpz_on_two_gpus)
    run_distributed(_cpu_body, CPU_WORLD, args=(str(tmp_path / "ckpt"),), timeout=TIMEOUT)


def _gpu_body(ctx):
    _parity_body(ctx, 2, [("eager", 1, None), ("inductor", 1, None), ("eager", 2, None)])
    _bytes_body(ctx, 2)


@pytest.mark.gpu
@pytest.mark.world_size(2)
def test_hpz_on_two_gpus():
    """2 GPUs: the secondary group spans both (a second NCCL communicator beside the world's)."""
    require_world_size(2)
    run_distributed(_gpu_body, 2, timeout=TIMEOUT)
