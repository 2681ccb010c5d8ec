"""DeepSpeed's rows of ``bench/train_bench.py``: DeepSpeed ZeRO-3 (eager) and DeepSpeed DeepCompile,
built from the options the deepcompile rows read, so a table compares like with like.

Every DeepSpeed row trains the same model (built by train_bench in bf16, same seed) on the same
batches with ``bf16.enabled``, micro-batch ``--micro-batch``, no gradient accumulation, ZeRO stage 3
with ``--reduce-bucket-size``, ``--persistence-threshold`` and (when given) ``--sub-group-size`` and
``--communication-data-type``. The optimizer is train_bench's own ``make_optimizer`` (torch AdamW,
the deepcompile rows' optimizer), handed to ``deepspeed.initialize`` as the client optimizer, except
with ZeRO's ``offload_optimizer``: there DeepSpeed refuses a client optimizer by default and its own
offload recipe is its CPU Adam, so the config names ``AdamW`` with the hyper-parameters read from
``make_optimizer``'s defaults.

The rows (``--methods`` keys):

* ``ds-z3``: DeepSpeed ZeRO-3, eager (its module hooks gather and release; no compilation).
* ``ds-z3-offload-opt``: plus ``zero_optimization.offload_optimizer`` on the host.
* ``ds-z3-offload``: plus ``offload_optimizer`` and ``offload_param`` on the host (ZeRO-Infinity's
  CPU recipe, FSDP2 + CPU offload's counterpart).
* ``ds-dc``: DeepSpeed DeepCompile (``"compile": {"deepcompile": true}``, then ``engine.compile()``)
  on ZeRO-3. Its own schedule: plain gather/release from step 0, profile-guided prefetch and
  selective gathering from step 5 (so ``--warmup`` of at least ``MIN_WARMUP``).
* ``ds-dc-offload-opt`` / ``ds-dc-offload-param`` / ``ds-dc-offload-act``: plus DeepCompile's
  ``compile.offload_opt_states`` / ``offload_parameters`` / ``offload_activation`` (DeepSpeed takes
  one offload target per run; it plans them against the device's memory, not against
  ``--memory-budget-*``, which only deepcompile's rows read).

DeepSpeed rows run only in a process of their own (``--isolate``): DeepSpeed's DeepCompile registers
the torch op namespace ``dc``, which deepcompile's op library registers too, and DeepSpeed's ZeRO-3
patches torch (module construction, ``nn.functional.linear``) in the process that uses it.
``train_bench`` imports deepcompile only when a deepcompile row is built, so a DeepSpeed row's
process never loads it.

On a machine without CUDA, ``DS_ACCELERATOR`` defaults to ``cpu`` here (DeepSpeed's CPU accelerator
then talks gloo when oneCCL's bindings are absent, the process group train_bench made). DeepSpeed
runs DeepCompile on CUDA only: there its rows are "n/a" with that reason, and on CUDA a row whose
DeepCompile did not start is an error, not a time of DeepSpeed's fallback to plain ``torch.compile``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Dict, Optional, Tuple

import torch

from train_core import Runner, Unavailable, build_model, make_optimizer, model_config

# DeepSpeed DeepCompile's default ZeRO-3 schedule re-plans at step 5 (deepspeed/compile/init_z3.py's
# WARMUP): steps 0-5 compile, step 6 is the first that only runs. One more for a settled step.
MIN_WARMUP = 7
HOST_OFFLOAD_KEYS = ("ds-z3-offload-opt", "ds-z3-offload", "ds-dc-offload-opt", "ds-dc-offload-param",
                     "ds-dc-offload-act")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # the row label
    deepcompile: bool = False
    zero_offload: Tuple[str, ...] = ()  # "optimizer", "param": zero_optimization.offload_<what> on the host
    compile_offload: Optional[str] = None  # a DeepCompile offload option (compile.<this>: true)


VARIANTS: Dict[str, Variant] = {
    "ds-z3": Variant("DeepSpeed ZeRO-3"),
    "ds-z3-offload-opt": Variant("DeepSpeed ZeRO-3 + offload_optimizer", zero_offload=("optimizer",)),
    "ds-z3-offload": Variant("DeepSpeed ZeRO-3 + offload_optimizer + offload_param",
                             zero_offload=("optimizer", "param")),
    "ds-dc": Variant("DeepSpeed DeepCompile ZeRO-3", deepcompile=True),
    "ds-dc-offload-opt": Variant("DeepSpeed DeepCompile ZeRO-3 + offload_opt_states", deepcompile=True,
                                 compile_offload="offload_opt_states"),
    "ds-dc-offload-param": Variant("DeepSpeed DeepCompile ZeRO-3 + offload_parameters", deepcompile=True,
                                   compile_offload="offload_parameters"),
    "ds-dc-offload-act": Variant("DeepSpeed DeepCompile ZeRO-3 + offload_activation", deepcompile=True,
                                 compile_offload="offload_activation"),
}
ROWS: Dict[str, str] = {key: v.name for key, v in VARIANTS.items()}  # train_bench's table rows


def adamw_params(defaults: Dict[str, object]) -> Dict[str, object]:
    """DeepSpeed's ``optimizer.params`` for the hyper-parameters of a torch AdamW (its ``defaults``)."""
    return {"lr": float(defaults["lr"]), "betas": [float(b) for b in defaults["betas"]],
            "eps": float(defaults["eps"]), "weight_decay": float(defaults["weight_decay"])}


def deepspeed_config(args: argparse.Namespace, key: str, adamw: Dict[str, object], pin_memory: bool) -> dict:
    """The DeepSpeed config of row ``key`` from train_bench's options (a pure function: no DeepSpeed
    import). ``adamw``: :func:`adamw_params` of train_bench's optimizer, named in the config only
    where ZeRO offloads the optimizer (elsewhere the client optimizer carries them)."""
    variant = VARIANTS[key]
    zero: Dict[str, object] = {
        "stage": 3,
        "reduce_bucket_size": int(args.reduce_bucket_size),
        "stage3_param_persistence_threshold": int(args.persistence_threshold),
    }
    if args.sub_group_size is not None:
        zero["sub_group_size"] = int(args.sub_group_size)
    for what in variant.zero_offload:
        zero[f"offload_{what}"] = {"device": "cpu", "pin_memory": pin_memory}
    config: Dict[str, object] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,  # its own progress lines would interleave with the table's
    }
    if args.communication_data_type is not None:
        config["communication_data_type"] = args.communication_data_type
    if "optimizer" in variant.zero_offload:
        config["optimizer"] = {"type": "AdamW", "params": dict(adamw)}
    if variant.deepcompile:
        config["compile"] = {"deepcompile": True}
        if variant.compile_offload:
            config["compile"][variant.compile_offload] = True
    return config


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace, keys) -> None:
    """train_bench's option checks for DeepSpeed rows among ``keys`` (``parser.error`` on a bad one)."""
    rows = [k for k in keys if k in VARIANTS]
    if rows and not (args.isolate or args.child_json):
        parser.error(f"{', '.join(rows)}: DeepSpeed's rows run only with --isolate (each row in its own process: "
                     "DeepSpeed DeepCompile registers the op namespace `dc` that deepcompile registers too); e.g. "
                     "python3 bench/train_bench.py --isolate --nproc 2 --methods ...")
    if args.warmup < MIN_WARMUP and any(VARIANTS[k].deepcompile for k in rows):
        parser.error(f"--warmup must be >= {MIN_WARMUP} with DeepSpeed DeepCompile rows "
                     "(its schedule re-plans at step 5)")


def _import_deepspeed(ctx):
    # DeepSpeed picks its accelerator at import: on a CPU run make it the CPU one (gloo without oneCCL).
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.is_cuda else "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise Unavailable(f"DeepSpeed not installed ({e}); scripts/fetch_deepspeed_wheels.sh here, "
                          "scripts/gpu_deepspeed.sh on the GPU machine") from e
    return deepspeed


def runner(ctx, key: str):
    """train_bench's ``Runner`` of DeepSpeed row ``key``."""
    variant = VARIANTS[key]
    deepspeed = _import_deepspeed(ctx)
    if variant.deepcompile:
        from deepspeed.compile.util import is_deepcompile_supported

        if not is_deepcompile_supported():  # before building its op library, minutes of C++ for nothing
            raise Unavailable("DeepSpeed runs DeepCompile on CUDA only (its is_deepcompile_supported() is "
                              f"False with accelerator {deepspeed.get_accelerator().device_name()}); on this "
                              "device it would fall back to plain torch.compile")
    reference = make_optimizer(ctx, [torch.nn.Parameter(torch.zeros(1))])  # only its hyper-parameters
    config = deepspeed_config(ctx.args, key, adamw_params(reference.defaults), pin_memory=ctx.is_cuda)
    if ctx.args.init == "meta":
        # DeepSpeed's own large-model construction, partitioned as built. transformers' init then runs on
        # partitions, so the initial values (and the loss column) differ from the other rows'; the times do not.
        torch.manual_seed(ctx.args.seed)
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM(model_config(ctx.args))
        model.train()
    else:
        model = build_model(ctx, torch.bfloat16)  # as deepcompile's rows: bf16 on the device, same seed
    client = None if "optimizer" in variant.zero_offload else make_optimizer(ctx, model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=config, dist_init_required=False,
                                      model_parameters=model.parameters() if client is None else None)
    last_replan = 0
    if variant.deepcompile:
        try:
            engine.compile(backend=ctx.backend)
            if not engine.is_deepcompile_active():
                # DeepSpeed falls back to plain torch.compile where its DeepCompile declines the config.
                raise RuntimeError("DeepSpeed DeepCompile did not start: DeepSpeed fell back to plain torch.compile "
                                   "(its log above says why)")
        except BaseException:
            engine.destroy()  # no Runner owns it yet
            raise
        from deepspeed.compile import backend as ds_backend

        last_replan = max((s for s, _ in ds_backend.remaining_schedule), default=0)
    state = {"scheduled": not variant.deepcompile}

    def step(tokens: torch.Tensor) -> torch.Tensor:
        before = engine.global_steps
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        # DeepCompile re-plans and recompiles at the schedule's steps; from its last one on, the final plan runs.
        state["scheduled"] = not variant.deepcompile or before >= last_replan
        return loss

    def note() -> str:
        notes = [f"DeepSpeed {deepspeed.__version__}"]
        if client is None:  # ZeRO's optimizer wraps the one that steps (DeepSpeed's CPU Adam under offload_optimizer)
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
            notes.append(f"optimizer {type(inner).__name__} (AdamW, the same hyper-parameters)")
        if variant.deepcompile:
            notes.append(f"last re-plan at step {last_replan}")
        return "; ".join(notes)

    return Runner(step, close=engine.destroy, note=note, scheduled=lambda: state["scheduled"])
