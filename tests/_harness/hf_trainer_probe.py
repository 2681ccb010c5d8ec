"""examples/hf_trainer.py run unchanged, with test probes around the served ``deepspeed.initialize``.

    torchrun ... tests/_harness/hf_trainer_probe.py --probe-out P [--poison-step N --poison-rank R] -- <example args>

Every rank writes ``P.rank<r>.json``:

* ``at_initialize``: how each parameter was held when Trainer called ``deepspeed.initialize``
  (built inside the served ``zero.Init`` or not, the bytes its ``.data`` owns, the elements of
  its value this rank holds) and the total element count of the model;
* ``buffers``: every buffer of the model after ``initialize`` (rotary ``inv_freq`` among them);
* ``topology``: the engine's shard groups (hybrid or not, shard size, replicas);
* ``scales``: per optimizer step, the loss scale, ``optimizer.overflow``, a checksum of this
  rank's parameter values after the step (what a skipped step leaves unchanged) and the step's
  bytes per link (``step_report.comm_bytes``);
* with ``--save-shards``: ``P.rank<r>.shards.pt``, per optimizer step this rank's shard of every
  parameter (name -> values, after the step), for elementwise comparisons;
* ``precision``: what the run computed in: the dtypes of every ``linear`` of the graphs deepcompile's
  backend compiled (weight, input, output), of the ``nn.Linear`` calls that ran eagerly
  (uncompiled), what ZeRO-3's gathers return, the master shards and the gradient partitions the
  reductions fill (at each optimizer step);
* ``compile_calls``: the engine's ``compile()`` calls after ``initialize`` returned (accelerate's
  ``engine.compile`` under ``torch_compile`` must not compile a second time), whether the engine
  was compiled, and the run summary line it logged;
* with ``--poison-step N``: on rank R, the gradient of the embedding output at training
  micro-step N (counted from 0) holds an inf, so that step overflows on that rank only.

Probes are command-line arguments, not environment variables: nothing leaks into the pytest
process or the next launch.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

import deepcompile

deepcompile.serve_as_deepspeed()

import deepspeed  # noqa: E402  (deepcompile's, served)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from deepcompile.integrations.deepspeed_api import zero_init  # noqa: E402
from poison_grad import PoisonGrad  # noqa: E402  (this folder: the probe runs as a script)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "hf_trainer.py")


def _held(model: torch.nn.Module) -> dict:
    held = zero_init.held_elements(model)
    params = {}
    for name, p in model.named_parameters():
        params[name] = {"deferred": name in held, "data_bytes": p.untyped_storage().nbytes(),
                        "held_elements": held.get(name, p.numel()), "numel": p.numel()}
    return params


def _spy_compiled_linears(record: dict) -> None:
    """Record the dtypes of every linear in the graphs deepcompile's backend is handed."""
    from deepcompile.compiler.backend import DeepCompileBackend

    linears = (torch._C._nn.linear, torch.nn.functional.linear)
    real_call = DeepCompileBackend.__call__

    def spy(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in linears:
                values = [a.meta["example_value"] for a in node.args[:2]] + [node.meta["example_value"]]
                record.setdefault("compiled_linears", []).append([str(v.dtype) for v in values])
        return real_call(self, gm, example_inputs)

    DeepCompileBackend.__call__ = spy


def _spy_eager_linears(model: torch.nn.Module, record: dict) -> None:
    """Record the dtypes of ``nn.Linear`` calls that run eagerly in training (not traced)."""
    def hook(module, inputs, out):
        if module.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            seen = record.setdefault("eager_linears", [])
            entry = [str(module.weight.dtype), str(inputs[0].dtype), str(out.dtype)]
            if entry not in seen:
                seen.append(entry)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook)


def _state_dtypes(engine, record: dict) -> None:
    """What ZeRO-3's gathers return, the masters and the gradient partitions hold (this step)."""
    from deepcompile import runtime

    sharding = engine.engine.sharding
    params = getattr(sharding, "params", [])
    precision = record.setdefault("precision", {})
    precision.setdefault("gather", sorted({str(runtime.gather_dtype(sp.ds_id)) for sp in params}))
    precision.setdefault("masters", sorted({str(sp.master.dtype) for sp in params if sp.master is not None}))
    grads = {str(runtime.grad_target(sp.ds_id).dtype) for sp in params
             if sp.trainable and runtime.grad_target(sp.ds_id) is not None}
    precision["grad_partitions"] = sorted(set(precision.get("grad_partitions", [])) | grads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe-out", required=True)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--poison-rank", type=int, default=1)
    parser.add_argument("--save-shards", action="store_true")
    ours, rest = sys.argv[1:], []
    if "--" in ours:
        cut = ours.index("--")
        ours, rest = ours[:cut], ours[cut + 1:]
    args = parser.parse_args(ours)
    record: dict = {"scales": [], "compile_calls": 0}
    shards_per_step: list = []
    real_initialize = deepspeed.initialize
    _spy_compiled_linears(record)

    def initialize(*a, **kw):
        model = kw.get("model")
        record["at_initialize"] = _held(model)
        _spy_eager_linears(model, record)
        if args.poison_step >= 0:
            micro = {"n": 0}

            # Run eagerly (the engine compiles the model): it counts micro-steps in Python and
            # poisons one of them, which a traced graph would either bake in or guard on.
            @torch.compiler.disable
            def poison(module, inputs, out):
                if not (module.training and torch.is_grad_enabled()):
                    return out
                step, micro["n"] = micro["n"], micro["n"] + 1
                hit = step == args.poison_step and dist.get_rank() == args.poison_rank
                return PoisonGrad.apply(out) if hit else out

            model.get_input_embeddings().register_forward_hook(poison)
        engine, optimizer, loader, scheduler = real_initialize(*a, **kw)
        record["buffers"] = {n: b.tolist() for n, b in engine.module.named_buffers()}
        record["fp16"] = engine.fp16_enabled()
        topology = engine.engine.topology
        record["topology"] = {"hybrid": topology.hybrid, "shard_size": topology.shard_size,
                              "replicas": topology.replicas}
        real_step = engine.step
        real_compile = engine.engine.compile

        def compile_spy(*ca, **ckw):
            record["compile_calls"] += 1
            return real_compile(*ca, **ckw)

        engine.engine.compile = compile_spy
        record["compiled_at_initialize"] = engine.engine.compiled_as is not None
        for size in ("reduce_bucket_size", "stage3_prefetch_bucket_size"):
            record[size] = getattr(engine.engine.config.zero_optimization, size)
            record["given_" + size] = engine.config["zero_optimization"][size]
        record["block_numel"] = max(sum(p.numel() for p in layer.parameters())
                                    for layer in engine.module.model.layers)

        def step(*sa, **skw):
            if engine.engine.stage == 3:
                _state_dtypes(engine, record)
            record["summary"] = engine.summary_line
            record["compiled"] = engine.engine.compiled_as is not None and engine.engine.compiled_as.describe()
            before = (engine.global_steps, engine.skipped_steps)
            real_step(*sa, **skw)
            if (engine.global_steps, engine.skipped_steps) != before:  # an optimizer step, applied or skipped
                shards = engine.engine.sharding.shards()
                record["scales"].append({"scale": float(engine.optimizer.cur_scale),
                                         "overflow": bool(engine.optimizer.overflow),
                                         "checksum": sum(float(s.local.double().sum()) for s in shards),
                                         "comm_bytes": engine.engine.step_report.comm_bytes})
                if args.save_shards:
                    shards_per_step.append({s.name: s.local.detach().cpu().clone()
                                            for s in engine.engine.sharding.shards()})

        engine.step = step
        return engine, optimizer, loader, scheduler

    deepspeed.initialize = initialize
    sys.argv = [EXAMPLE, *rest]
    try:
        runpy.run_path(EXAMPLE, run_name="__main__")
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(f"{args.probe_out}.rank{rank}.json", "w") as f:
            json.dump(record, f)
        if args.save_shards:
            torch.save(shards_per_step, f"{args.probe_out}.rank{rank}.shards.pt")


if __name__ == "__main__":
    main()
