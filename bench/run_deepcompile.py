"""The deepcompile family of ``bench/train_bench.py``'s rows: ZeRO-1/2/3, the profile-guided passes,
regional compilation and the offload kinds, each a set of options of :func:`runner` (the rows table,
``train_rows.py``, names them). The config is a pure function of the options (:func:`deepcompile_config`),
so tests read it without an engine.
"""

from __future__ import annotations

import argparse
from typing import Dict, Optional, Tuple

import torch

import layouts
from train_core import GIB, Context, Runner, Unavailable, build_meta_model, build_model, make_optimizer, sync

OFFLOAD_PASSES = {"none": (), "prefetch": ("prefetch",), "auto": ("prefetch", "selective_gather")}


def offload_config(args: argparse.Namespace, offload: str, budget_bytes: Optional[int] = None) -> Dict[str, dict]:
    """The config sections an offload row adds (``offload``: none, optimizer, budget, all):
    ``{"zero_optimization": {...}, "compile": {...}}``, merged into the row's config."""
    zero: Dict[str, object] = {}
    comp: Dict[str, object] = {}
    if offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif offload in ("budget", "all"):
        comp["offload_opt_states"] = True
        if offload == "all":
            comp["offload_activation"] = True
            comp["offload_parameters"] = True
        if budget_bytes is not None:
            comp["memory_budget_bytes"] = int(budget_bytes)
        elif args.memory_budget_gib is None:
            comp["memory_budget_fraction"] = args.memory_budget_fraction
    elif offload != "none":
        raise ValueError(f"unknown offload kind {offload!r}")
    return {"zero_optimization": zero, "compile": comp}


def deepcompile_config(args: argparse.Namespace, stage: int, passes: Tuple[str, ...] = (), offload: str = "none",
                       budget_bytes: Optional[int] = None) -> dict:
    """A deepcompile row's config from the options (a pure function: tests read it without an engine)."""
    config = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": args.reduce_bucket_size,
            "stage3_param_persistence_threshold": args.persistence_threshold,
        },
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "compile": {
            "prefetch": "prefetch" in passes,
            "selective_gather": "selective_gather" in passes,
            "warmup_steps": 1,  # profile step 0, plan after it
        },
    }
    if args.memory_budget_gib is not None:
        config["compile"]["memory_budget_bytes"] = int(args.memory_budget_gib * 2**30)
    if args.sub_group_size is not None and stage == 3:
        config["zero_optimization"]["sub_group_size"] = int(args.sub_group_size)
    if args.communication_data_type is not None:
        config["communication_data_type"] = args.communication_data_type
    if args.optimizer_step_in_backward and stage == 3:
        config["compile"]["optimizer_step_in_backward"] = True
    layout = layouts.from_options(args)  # hybrid sharding / hpZ; passed through, validated by the config
    if layout.hpz_partition_size != 1 and stage != 3:  # parse_args refuses this first; other callers too
        raise ValueError(f"hpZ (zero_hpz_partition_size {layout.hpz_partition_size}) is ZeRO-3 only, not ZeRO-{stage}")
    config["zero_optimization"].update(layout.zero_keys())
    for section, values in offload_config(args, offload, budget_bytes).items():
        config[section].update(values)
    return config


def deepcompile_runner(ctx: Context, stage: int, passes: Tuple[str, ...] = (), offload: str = "none",
                       budget_bytes: Optional[int] = None, regional: bool = False) -> Runner:
    import deepcompile  # here: a DeepSpeed row's process must not load its `dc` op library (deepspeed_peer.py)

    config = deepcompile_config(ctx.args, stage, passes, offload, budget_bytes)
    meta = ctx.args.init == "meta"
    # deepcompile trains the bf16 model (fp32 masters in the engine): built on the device in bf16,
    # or on meta and materialised by initialize() one module at a time.
    model = build_meta_model(ctx, torch.bfloat16) if meta else build_model(ctx, torch.bfloat16)
    optimizer = make_optimizer(ctx, model.parameters())  # re-targeted at the fp32 master shards
    init = dict(init_fn=model._init_weights, device=ctx.device) if meta else {}
    if meta:
        torch.manual_seed(ctx.args.seed)  # init_fn runs from rank 0's generator state
    try:
        engine = deepcompile.initialize(model, optimizer, config, **init)
    except BaseException as e:
        deepcompile.runtime.cleanup()  # initialize may fail after creating the runtime
        if offload == "all" and isinstance(e, (ValueError, NotImplementedError)):
            # An offload kind this build refuses (config validation): the row says which, the table goes on.
            raise Unavailable("unavailable: " + " ".join(str(e).split())[:300]) from e
        raise
    engine.compile(backend=ctx.backend, regional=regional)

    final = engine.scheduler.schedule.entry_at(1 << 62)  # the plan in force once every entry applied
    last = {"scheduled": False}

    def step(tokens: torch.Tensor) -> torch.Tensor:
        planned = engine.scheduler.applied == final
        loss = engine(input_ids=tokens, labels=tokens).loss
        profiled = engine.scheduler.mode is not None  # this micro-step runs through the profiler
        engine.backward(loss)
        engine.step()
        last["scheduled"] = planned and not profiled
        return loss

    def note() -> str:
        # ZeRO-3 parameters used outside the compiled graphs (graph breaks) are gathered by
        # module hooks, unscheduled: correct but slower. Say so rather than hide it in the time.
        eager = engine.eagerly_gathered_params() if stage == 3 else []
        what = "outside the compiled layers" if regional else "(graph breaks)"
        notes = [f"{len(eager)} parameters gathered eagerly {what}"] if eager else []
        step_in_backward = engine.sharding.backward_step
        if step_in_backward is not None:  # compile.optimizer_step_in_backward: how much it took on
            notes.append(f"{len(step_in_backward.stepped_last_window)} of {len(step_in_backward.trainable)} "
                         "parameters stepped in the last backward")
        if getattr(engine, "offload", None) is not None:
            notes.append(offload_note(engine.offload.report()))
        if offload != "none":
            sync(ctx)
            if ctx.is_cuda:
                notes.append(f"between steps {torch.cuda.memory_allocated(ctx.device) / GIB:.2f} GiB")
        return "; ".join(notes)

    def comm_bytes() -> Optional[Dict[str, Dict[str, int]]]:
        counted = engine.step_report.comm_bytes  # replaced (not updated) at every optimizer step
        return {link: dict(kinds) for link, kinds in counted.items()} if counted else None

    return Runner(step, close=engine.destroy, note=note, scheduled=lambda: last["scheduled"], comm_bytes=comm_bytes)


def offload_note(r: Dict[str, object]) -> str:
    """What the optimizer-state offload plan moved (``engine.offload.report()``)."""
    total = (r.get("offloaded_bytes") or 0) + (r.get("resident_bytes") or 0)
    budget = r.get("budget_bytes")
    return (f"opt states offloaded {size(r.get('offloaded_bytes') or 0)} of {size(total)}, "
            f"reloaded in backward {size(r.get('reloaded_during_backward_bytes') or 0)}, budget "
            + (size(budget) if budget else "none"))


def size(nbytes: float) -> str:
    """GiB, or MiB below one GiB (the tiny CPU models)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"



def runner(ctx: Context, stage: int, passes: Tuple[str, ...] = (), offload: str = "none", regional: bool = False,
           offload_passes: bool = False) -> Runner:
    """A deepcompile row of the table: ``offload_passes`` takes the passes from ``--offload-passes``
    (the offload rows), else ``passes``."""
    if offload_passes:
        passes = OFFLOAD_PASSES[ctx.args.offload_passes]
    return deepcompile_runner(ctx, stage, passes, offload, regional=regional)
