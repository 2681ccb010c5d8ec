"""deepcompile's ``deepspeed``: what ``import deepspeed`` returns after
``deepcompile.serve_as_deepspeed()``.

The part of DeepSpeed's public surface that Hugging Face Trainer and accelerate use on their
ZeRO paths (read from their sources; docs/huggingface.md lists it), implemented over
:class:`deepcompile.Engine`. Every other name raises an error that names it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from deepcompile.integrations.deepspeed_api import accelerator, checkpoint, comm, ops, runtime, utils, zero  # noqa: F401
from deepcompile.integrations.deepspeed_api import filled_sizes, frozen_engine, frozen_zero3, served_config, zero_init
from deepcompile.integrations.deepspeed_api._missing import missing, module_getattr
from deepcompile.integrations.deepspeed_api.accelerator import get_accelerator  # noqa: F401
from deepcompile.integrations.deepspeed_api.arguments import add_config_arguments  # noqa: F401
from deepcompile.integrations.deepspeed_api.comm import init_distributed
from deepcompile.integrations.deepspeed_api.engine import BoundaryEngine, DeepSpeedEngine
from deepcompile.integrations.deepspeed_api.training_data import data_loader as training_data_loader

# The DeepSpeed release whose interface this follows (transformers and accelerate gate features
# on it); the local label says who implements it. 0.20.2, not older: transformers >= 5.25 builds
# its sequence-parallel loss for how DeepSpeed reduces gradients from that release on (summed over
# the sequence-parallel group at every stage) and rescales it at ZeRO-3 for older releases; the
# engine sums such a loss over the group at every stage (sequence_parallel/loss.py), so an older
# number would scale ZeRO-3's gradients by the group's size. No other version branch of
# transformers, accelerate, TRL, PEFT or Lightning lies between 0.19.8 and 0.20.2.
DEEPSPEED_API_VERSION = "0.20.2"
__version__ = DEEPSPEED_API_VERSION + "+deepcompile"
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in DEEPSPEED_API_VERSION.split("."))


def _config_dict(config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ValueError("deepspeed.initialize: pass the config as config= or config_params=, not both")
    cfg = config if config is not None else config_params
    if cfg is None:
        raise ValueError("deepspeed.initialize needs a config (config= or config_params=)")
    return cfg


def _stage(cfg: Any) -> Any:
    """The ZeRO stage asked for, from a dict as written or from a parsed Config."""
    return served_config.zero_stage(cfg) if isinstance(cfg, dict) else cfg.zero_optimization.stage


def _sequence_parallel_mpu(mpu: Any) -> Any:
    if mpu is None:
        return None
    from deepcompile.integrations.deepspeed_api.runtime.sequence_parallel.ulysses_sp import SequenceParallelMPU

    if not isinstance(mpu, SequenceParallelMPU):
        raise missing("deepspeed.initialize(mpu=...)")
    return mpu


def _with_sequence_parallel(cfg: Any, mpu: Any) -> Any:
    """The config with ``sequence_parallel_size`` the mpu's size (a size already there must agree)
    and, where it names one, a micro batch that agrees with the one registration was given."""
    from deepcompile.sequence_parallel import SIZE_KEY

    size = mpu.get_sequence_parallel_world_size()
    if isinstance(cfg, dict):
        given, micro = cfg.get(SIZE_KEY), cfg.get("train_micro_batch_size_per_gpu")
    else:
        given, micro = getattr(cfg, SIZE_KEY), cfg.train_micro_batch_size_per_gpu
    if given is not None and given != size:
        raise ValueError(f"deepspeed.initialize: the config's {SIZE_KEY} is {given}, but the mpu (from "
                         f"UlyssesSPAttentionHF.register_with_transformers) has sequence-parallel size {size}")
    if isinstance(micro, int) and mpu.micro_batch_size is not None and micro != mpu.micro_batch_size:
        raise ValueError(f"deepspeed.initialize: the config's train_micro_batch_size_per_gpu is {micro}, but "
                         f"UlyssesSPAttentionHF.register_with_transformers was given micro_batch_size="
                         f"{mpu.micro_batch_size}")
    if not isinstance(cfg, dict):
        return cfg  # a parsed Config already says sequence_parallel_size (checked above)
    # The served engine compiles at initialize (compile_by_default), which sequence parallelism
    # needs; a config that switches that off (compile.auto_compile false) is refused by its rules.
    return {**cfg, SIZE_KEY: size}


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: Any = None, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> Tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, data loader, lr_scheduler)``,
    the engine a :class:`DeepSpeedEngine` over :class:`deepcompile.Engine`, the loader built from
    ``training_data`` (None without it, training_data.py)."""
    if mesh_param is not None:
        raise missing("deepspeed.initialize(mesh_param=...)")
    # The mpu of the served UlyssesSPAttentionHF.register_with_transformers (ALST / Ulysses):
    # its size becomes sequence_parallel_size. Any other mpu (Megatron's) is refused.
    sp_mpu = _sequence_parallel_mpu(mpu)
    if collate_fn is not None and training_data is None:
        raise ValueError("deepspeed.initialize(collate_fn=...) is the collate function of the loader built from "
                         "training_data, which was not given")
    if args is not None and getattr(args, "deepspeed_config", None) and config is None and config_params is None:
        config = args.deepspeed_config
    # What DeepSpeed tolerates and deepcompile.initialize refuses (served_config.py): dotted
    # top-level keys are dropped with a warning.
    cfg = served_config.drop_dotted_keys(served_config.as_dict(_config_dict(config, config_params)))
    if model is None:
        raise ValueError("deepspeed.initialize needs a model")
    if sp_mpu is not None:
        cfg = _with_sequence_parallel(cfg, sp_mpu)
    # No optimizer anywhere: an engine that only evaluates (a reference/teacher model, ZeRO
    # inference, Lightning's inference path with model_parameters=[]).
    inference = served_config.has_no_optimizer(cfg, optimizer, model_parameters, lr_scheduler)
    if inference and training_data is not None:
        raise ValueError("deepspeed.initialize(training_data=...) with no optimizer: the engine only evaluates a "
                         "model that is never trained; build a DataLoader for the evaluation yourself")
    if sp_mpu is not None and inference:
        raise ValueError("deepspeed.initialize(mpu=...): sequence parallelism (the mpu of "
                         "UlyssesSPAttentionHF.register_with_transformers) is supported for training only; this "
                         "engine has no optimizer, and deepcompile's engines that only evaluate do not split sequences")
    if served_config.zero_stage(cfg) == 0:
        if not inference:
            raise ValueError("deepspeed.initialize: ZeRO stage 0 (zero_optimization.stage 0, DeepSpeed's default "
                             "without a zero_optimization section) is supported only for a model that is never "
                             "trained (no optimizer, no optimizer section, no model_parameters); deepcompile has no "
                             "stage 0 training: set zero_optimization.stage to 1, 2 or 3")
        init_distributed()
        # DeepSpeed runs such a model whole on every rank: nothing to partition (frozen_engine.py).
        return frozen_engine.build(model, cfg), None, None, None
    init_distributed()
    if inference and _stage(cfg) == 3:
        # A frozen model at ZeRO-3 (TRL's reference model beside a ZeRO-3 policy): partitioned
        # and gathered per module over torch.distributed alone, so that it shares no per-process
        # state with a trained engine in the same process (frozen_zero3.py).
        return frozen_zero3.build(model, cfg if isinstance(cfg, dict) else cfg.to_dict()), None, None, None
    # A model a frozen ZeRO-3 engine held (Trainer's evaluate() before train()): its shards are
    # handed over as zero.Init's slices are (frozen_zero3.hand_back).
    frozen_zero3.hand_back(model)
    # Parameters built inside deepspeed.zero.Init: each rank holds a slice; the engine gathers
    # them one at a time as it partitions (zero_init.py).
    never_set = zero_init.hand_over(model)
    if never_set:
        raise ValueError(f"deepspeed.initialize: parameters {never_set} were built inside deepspeed.zero.Init and "
                         "never given a value (deepcompile keeps the values a module's own constructor sets, and "
                         "those written under zero.GatheredParameters(..., modifier_rank=...))")
    from deepcompile.config import Config

    # Sizes Trainer/accelerate filled for "auto" go back to deepcompile's own "auto" (filled_sizes.py).
    engine_cfg, unfilled = filled_sizes.unfill(cfg, model) if isinstance(cfg, dict) else (cfg, [])
    config = Config.from_any(engine_cfg)
    # ZeRO-1/2 inference (Trainer.evaluate()/predict() before any training): no optimizer anywhere.
    # deepcompile's engine partitions through an optimizer, so it gets one that never steps (SGD
    # at lr 0 keeps no state); the served engine refuses backward and step.
    if inference:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        model_parameters = None  # Lightning's [] means "none to train": the SGD above covers them all
    # Compiled by default (compile.auto_compile): a script switched to deepcompile runs the
    # compiled, scheduled step whether or not it asked for torch.compile.
    engine = BoundaryEngine(model, optimizer, config, lr_scheduler=lr_scheduler, model_parameters=model_parameters,
                            compile_by_default=not inference)
    filled_sizes.say_unfilled(unfilled, engine.config, engine.rank)
    raw: Dict[str, Any] = cfg if isinstance(cfg, dict) else config.to_dict()
    wrapped = DeepSpeedEngine(engine, raw, inference_only=inference)
    loader = None
    if training_data is not None:
        loader = training_data_loader(training_data, engine.config.train_micro_batch_size_per_gpu, collate_fn,
                                      engine.device)
    return wrapped, None if inference else wrapped.optimizer, loader, engine.lr_scheduler


__getattr__ = module_getattr("deepspeed")
