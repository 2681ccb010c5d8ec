"""The DeepSpeed keys that change nothing here, each with the reason, in one table.

deepcompile never accepts a key and then ignores it. A key that steers nothing in this runtime is
listed here in one of four kinds, and the section modules build the key's validator and
documentation from its row:

* ``FIXED_VALUE``: no effect by design; accepted only with the value that describes what the
  runtime does (``zero_optimization.contiguous_gradients: true``); any other value is an error
  that says what the runtime does instead.
* ``OFF_ONLY``: a DeepSpeed feature deepcompile lacks; accepted only switched off.
* ``INERT``: belongs to a feature that is off (a disabled monitor, fp16 loss scaling while fp16
  is refused); validated, no effect.
* ``NO_EFFECT``: the key steers something deepcompile has no counterpart for, and no value could
  change what happens; any valid value is accepted, and the row says why.

Every other accepted key is read by the code (``tests/config/test_config_package.py`` checks both).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from deepcompile.config.features import FP16_LOSS_SCALING

_AG_PARTITIONS = ("after the optimizer step the updated partitions are always all-gathered "
                  "(in chunks of allgather_bucket_size elements)")
_RS = ("ZeRO-1/2 gradients are always reduced to the ranks owning their partition (a reduce per owned range), "
       "never all-reduced")
_CONTIGUOUS = "gradients are always copied into contiguous reduce buckets as they are produced"
_RR = ("round-robin gradient partitioning parallelises gradient copies to the CPU for DeepSpeed's CPU-side "
       "optimizer step; deepcompile's offload_optimizer steps on the device and copies no gradient to the host")
_MEL = ("DeepSpeed's memory-efficient linear autograd function is not implemented; the ZeRO-3 graph pass "
        "gathers weights for the backward itself")
_FP32_MASTERS = "master weights and gradient partitions are always fp32"
_ACKPT = ("it configures DeepSpeed's activation-checkpointing API (deepspeed.checkpointing), which deepcompile does "
          "not provide; use torch.utils.checkpoint (e.g. a Hugging Face model's gradient_checkpointing_enable())")
_MONITOR = "monitoring backends are not implemented; log engine.get_lr() and the loss yourself"
_HYBRID = "DeepSpeed-Chat's hybrid (training + inference) engine is not implemented"
_AVERAGE = ("the runtime averages gradients inside the collective (NCCL's average op; gloo divides by the world size "
            "before summing); the split of the division around the sum only matters against fp16 overflow")
_PROFILE_INPUTS = ("deepcompile profiles each graph while it runs the step, on that step's real inputs, so no graph "
                   "input is kept alive for a later profiling run (what DeepSpeed's input storage keeps)")

# dotted key -> (the only accepted value, what the runtime does instead)
FIXED_VALUE: Dict[str, Tuple[Any, str]] = {
    "prescale_gradients": (False, _AVERAGE),
    "gradient_predivide_factor": (1.0, _AVERAGE),
    "zero_optimization.allgather_partitions": (True, _AG_PARTITIONS),
    "zero_optimization.reduce_scatter": (True, _RS),
    "zero_optimization.contiguous_gradients": (True, _CONTIGUOUS),
    "zero_optimization.round_robin_gradients": (False, _RR),
    "zero_optimization.memory_efficient_linear": (False, _MEL),
    "zero_optimization.zero_quantized_weights": (
        False, "ZeRO++ quantized weight gathers are not implemented; parameters are gathered in their training dtype"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        False, "ZeRO++ quantized storage of frozen weights is not implemented; they are stored in their dtype"),
    "zero_optimization.zero_quantized_gradients": (
        False, "ZeRO++ quantized gradient reduction is not implemented; gradients are reduced in "
               "communication_data_type"),
    "bf16.bf16_master_weights_and_grads": (False, _FP32_MASTERS),
    "fp16.fp16_master_weights_and_grads": (False, _FP32_MASTERS),
    "fp16.auto_cast": (False, "fp16 auto-casting of the forward's inputs is not implemented; the parameters are "
                              "cast to the training dtype at initialize and the inputs stay as given"),
    "activation_checkpointing.partition_activations": (False, _ACKPT),
    "activation_checkpointing.cpu_checkpointing": (False, _ACKPT),
    "activation_checkpointing.contiguous_memory_optimization": (False, _ACKPT),
    "activation_checkpointing.synchronize_checkpoint_boundary": (False, _ACKPT),
    "activation_checkpointing.profile": (False, _ACKPT),
    "tensorboard.enabled": (False, _MONITOR),
    "csv_monitor.enabled": (False, _MONITOR),
    "wandb.enabled": (False, _MONITOR),
    "hybrid_engine.enabled": (False, _HYBRID),
    "optimizer.legacy_fusion": (False, "it selects DeepSpeed's legacy fused fp16 optimizer; the optimizer is always "
                                       "the torch optimizer the section names"),
    "optimizer.params.bias_correction": (True, "torch's Adam/AdamW always correct the moment estimates' bias"),
    "scheduler.params.last_batch_iteration": (
        -1, "a schedule always starts at the first step; a resumed run gets its position from engine.load_checkpoint"),
    "compile.deepcompile": (
        True, "engine.compile() always compiles through deepcompile's passes (DeepSpeed's false means plain "
              "torch.compile around its ZeRO hooks, which this package does not have); to train without compiling, "
              "do not call engine.compile()"),
    "compile.keep_int_input_tensors": (
        True, _PROFILE_INPUTS + "; integer and bool inputs are seen with their real values"),
    "compile.keep_all_input_tensors": (False, _PROFILE_INPUTS),
}

# dotted key -> the feature deepcompile lacks (only false is accepted)
OFF_ONLY: Dict[str, str] = {
    "zero_optimization.cpu_offload": "ZeRO-Offload through the deprecated cpu_offload switch (use offload_optimizer)",
    "compile.symmetric_memory": "symmetric memory",
    # MiCS gathers a shard group that spans nodes in two hops (within the node, then across);
    # deepcompile's shard groups are meant to fit a node (mics_shard_size), where one hop is best.
    "zero_optimization.mics_hierarchical_params_gather": (
        "MiCS's two-hop (node-local, then cross-node) parameter gather (a shard group gathers in one collective: "
        "choose mics_shard_size to fit one node)"),
}

_MONITOR_KEY = "Belongs to the disabled monitor"
_HYBRID_KEY = "Belongs to the disabled hybrid engine"
_FP16_KEY = ("fp16 loss scaling; read only with fp16.enabled, which deepcompile refuses until its loss scaler "
             "lands (deepcompile/precision/)")

# dotted key -> why it has no effect (validated only)
INERT: Dict[str, str] = {
    "activation_checkpointing.number_checkpoints": "Buffer count of contiguous_memory_optimization, which is off",
    "tensorboard.output_path": _MONITOR_KEY,
    "tensorboard.job_name": _MONITOR_KEY,
    "csv_monitor.output_path": _MONITOR_KEY,
    "csv_monitor.job_name": _MONITOR_KEY,
    "wandb.group": _MONITOR_KEY,
    "wandb.team": _MONITOR_KEY,
    "wandb.project": _MONITOR_KEY,
    "hybrid_engine.max_out_tokens": _HYBRID_KEY,
    "hybrid_engine.inference_tp_size": _HYBRID_KEY,
    "hybrid_engine.release_inference_cache": _HYBRID_KEY,
    "hybrid_engine.pin_parameters": _HYBRID_KEY,
    "hybrid_engine.tp_gather_partition_size": _HYBRID_KEY,
}
_NVME_KEY = "An NVMe offload setting (NVMe offload is refused); no effect with device \"cpu\""
INERT.update({f"zero_optimization.offload_param.{name}": _NVME_KEY
              for name in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")})
INERT.update({f"zero_optimization.offload_optimizer.{name}": _NVME_KEY
              for name in ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init")})
FP16_SCALING_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                     "min_loss_scale")
if not FP16_LOSS_SCALING:
    INERT.update({f"fp16.{name}": _FP16_KEY for name in FP16_SCALING_KEYS})

# dotted key -> why no value could change what happens (any valid value is accepted)
NO_EFFECT: Dict[str, str] = {
    "zero_force_ds_cpu_optimizer": (
        "with offload_optimizer the optimizer state is reloaded and the step runs on the device with the user's "
        "optimizer; no CPU optimizer is substituted"),
    "optimizer.params.torch_adam": (
        "the update is always torch.optim's Adam/AdamW, which computes what DeepSpeed's FusedAdam (torch_adam "
        "false) computes"),
    "monitor_config": (
        "not a DeepSpeed key: DeepSpeed reads its monitors from the top-level tensorboard, wandb and csv_monitor "
        "sections and ignores this one (LLaMA-Factory's configs carry it), and so does deepcompile"),
    **{f"aio.{name}": ("it tunes DeepSpeed's asynchronous NVMe I/O, used only to offload to NVMe, which deepcompile "
                       "does not do (an offload device \"nvme\" is refused); Lightning's DeepSpeedStrategy always "
                       "writes this section")
       for name in ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count", "use_gds")},
    "comms_config": (
        "not a DeepSpeed key: DeepSpeed's communication logger is the comms_logger section and it ignores this one "
        "(LLaMA-Factory's configs carry it), and so does deepcompile"),
}


def handled_without_effect() -> Dict[str, str]:
    """Every key of the four tables -> its kind ("only <value>", "off only", "inert", "no effect")."""
    import json

    kinds = {k: f"only {json.dumps(v)}" for k, (v, _) in FIXED_VALUE.items()}
    kinds.update({k: "off only" for k in OFF_ONLY})
    kinds.update({k: "inert" for k in INERT})
    kinds.update({k: "no effect" for k in NO_EFFECT})
    return kinds
