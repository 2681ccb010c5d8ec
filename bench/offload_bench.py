"""Optimizer-state offload: deepcompile ZeRO-3 with and without it, against FSDP2 + CPU offload.

    torchrun --nproc-per-node 1 bench/offload_bench.py [--methods z3,z3-offload,...] [train_bench options]

One GPU, a Llama that fits without offload (default: hidden 2048, 8 layers, seq 1024, micro-batch
2; about 0.55 B parameters), so every row runs and the rows show what offload costs and saves:

* ``deepcompile ZeRO-3`` (``z3``): everything on the device;
* ``deepcompile ZeRO-3 + offload_optimizer`` (``z3-offload``): ``offload_optimizer: {"device":
  "cpu", "pin_memory": true}``: all Adam state on the host between steps, reloaded for the step;
* ``deepcompile ZeRO-3 + offload_opt_states, budget`` (``z3-offload-budget``):
  ``compile.offload_opt_states`` under ``--offload-budget-gib`` (default: the measured peak of
  ``z3`` minus half the Adam state, so the planner has to offload about half of it);
* ``FSDP2 + CPU offload + compile`` (``fsdp2-offload``): the peer: ``fully_shard`` per decoder
  layer and the root with ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the
  optimizer step on the host), ``MixedPrecisionPolicy(bf16, fp32)``, then ``torch.compile``.

Timing, memory and the other columns are train_bench.py's (its docstring says how each is taken;
this script reuses its measuring code and only adds rows). The note of an offload row gives the
bytes offloaded and the device memory held between steps (``memory_allocated`` after the last
step, synchronised).

About 4-5 minutes on one H100 with the defaults (three compiles of the 8-layer model dominate).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_bench as tb  # noqa: E402  (bench/ is not a package; this script only adds rows to its table)

GIB = 1024**3
OFFLOAD_DEFAULTS = ["--hidden", "2048", "--layers", "8", "--heads", "16", "--intermediate", "5632", "--seq", "1024",
                    "--micro-batch", "2", "--warmup", "3", "--steps", "5",
                    "--methods", "z3,z3-offload,z3-offload-budget,fsdp2-offload"]
# Set from the z3 row when --offload-budget-gib is not given.
_measured = {"z3_peak": None, "adam_bytes": None}
_budget_gib: Optional[float] = None


def _adam_bytes(ctx: tb.Context) -> int:
    """fp32 exp_avg + exp_avg_sq of this rank's shards."""
    return 2 * 4 * -(-ctx.n_params // ctx.world)


def offload_runner(ctx: tb.Context, offload: str) -> tb.Runner:
    import deepcompile

    model = tb.build_model(ctx, torch.bfloat16)
    optimizer = tb.make_optimizer(ctx, model.parameters())
    config = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": ctx.args.reduce_bucket_size,
                              "stage3_param_persistence_threshold": ctx.args.persistence_threshold},
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": ctx.args.micro_batch,
        "compile": {"prefetch": False, "selective_gather": False},
    }
    if offload == "all":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif offload == "budget":
        budget = _budget_gib
        if budget is None:
            if _measured["z3_peak"] is None:
                raise tb.Unavailable("needs --offload-budget-gib or the z3 row before it")
            budget = (_measured["z3_peak"] - _adam_bytes(ctx) // 2) / GIB
        config["compile"]["offload_opt_states"] = True
        config["compile"]["memory_budget_bytes"] = int(budget * GIB)
    engine = deepcompile.initialize(model, optimizer, config)
    engine.compile(backend=ctx.backend)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return loss

    def note() -> str:
        tb.sync(ctx)
        between = torch.cuda.memory_allocated(ctx.device) / GIB if ctx.is_cuda else float("nan")
        if offload == "none":
            if ctx.is_cuda:
                _measured["z3_peak"] = torch.cuda.max_memory_allocated(ctx.device)
            return f"between steps {between:.2f} GiB"
        r = engine.offload.report()
        return (f"offloaded {r['offloaded_bytes'] / GIB:.2f} GiB of {(r['offloaded_bytes'] + r['resident_bytes']) / GIB:.2f}"
                f" GiB, reloaded in backward {r['reloaded_during_backward_bytes'] / GIB:.2f} GiB, budget "
                f"{(r['budget_bytes'] or 0) / GIB:.1f} GiB; between steps {between:.2f} GiB")

    return tb.Runner(step, close=engine.destroy, note=note)


def fsdp2_offload_runner(ctx: tb.Context) -> tb.Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not ctx.is_cuda:
        raise tb.Unavailable("CPUOffloadPolicy needs a CUDA device")
    model = tb.build_model(ctx, torch.float32)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    optimizer = tb.make_optimizer(ctx, model.parameters())  # host DTensor shards: the step runs on the CPU
    return tb.torch_training_runner(torch.compile(model, backend=ctx.backend), optimizer)


ROWS = {
    "z3": tb.Method("deepcompile ZeRO-3", lambda ctx: offload_runner(ctx, "none")),
    "z3-offload": tb.Method("deepcompile ZeRO-3 + offload_optimizer", lambda ctx: offload_runner(ctx, "all")),
    "z3-offload-budget": tb.Method("deepcompile ZeRO-3 + offload_opt_states, budget",
                                   lambda ctx: offload_runner(ctx, "budget")),
    "fsdp2-offload": tb.Method("FSDP2 + CPU offload + compile", fsdp2_offload_runner),
}


def main(argv: Optional[List[str]] = None) -> int:
    global _budget_gib
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--offload-budget-gib" in argv:
        i = argv.index("--offload-budget-gib")
        _budget_gib = float(argv[i + 1])
        del argv[i:i + 2]
    # The script's defaults first; options given on the command line override them.
    tb.METHODS.clear()
    tb.METHODS.update({key: dataclasses.replace(m, key=key) for key, m in ROWS.items()})
    return tb.main(OFFLOAD_DEFAULTS + argv)


if __name__ == "__main__":
    sys.exit(main())
