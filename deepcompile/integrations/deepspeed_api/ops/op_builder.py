"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, answering as a DeepSpeed none of whose
optional C++/CUDA ops were built or can be built.

Programs ask a builder before they use its op (``AsyncIOBuilder().is_compatible()`` before NVMe
offload, ``CPUAdamBuilder().is_compatible()`` before DeepSpeed's CPU Adam; transformers' own
DeepSpeed tests skip their NVMe cases on ``deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]``).
deepcompile compiles none of these extensions: what it serves in their place are torch code paths
(``deepspeed.ops.adam`` is torch's Adam, NVMe offload is refused by the config). So every builder
here reports not compatible, and loading one raises an error naming the op.

Each builder class has DeepSpeed's ``NAME`` (the op's key in ``__compatible_ops__``) and
``BUILD_VAR`` (the ``DS_BUILD_*`` variable that would pre-build it); an instance has ``name``,
``is_compatible(verbose=False)`` (False), ``error_log`` (why), and ``load``/``jit_load``, which
raise. A builder name DeepSpeed does not have fails to import, as there.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from deepcompile.integrations.deepspeed_api._missing import module_getattr, refused


class OpBuilder:
    """Base of the builders: an op deepcompile does not build."""

    NAME = "deepspeed_op"
    BUILD_VAR = "DS_BUILD_OPS"

    def __init__(self, name: Optional[str] = None):
        self.name = name if name is not None else self.NAME
        self.jit_mode = False
        self.error_log = (f"deepcompile does not build DeepSpeed's {self.name} op "
                          "(deepcompile.serve_as_deepspeed() serves DeepSpeed's Python interface only)")

    def is_compatible(self, verbose: bool = False) -> bool:
        """False: the op cannot be loaded in this process (``verbose`` is accepted and ignored)."""
        return False

    def load(self, verbose: bool = False):
        raise refused(f"DeepSpeed's {self.name} op ({type(self).__name__}.load(): deepcompile builds none of "
                      "DeepSpeed's C++/CUDA extensions, and this builder's is_compatible() is False)",
                      _INSTEAD.get(self.name, "check is_compatible() before loading an op, as DeepSpeed's own "
                                              "callers do"))

    def jit_load(self, verbose: bool = True):
        return self.load(verbose)


class CUDAOpBuilder(OpBuilder):
    pass


class TorchCPUOpBuilder(CUDAOpBuilder):
    pass


# What a caller can use instead of the op, where deepcompile has something.
_INSTEAD = {
    "async_io": "NVMe offload is not implemented; offload to host memory with \"device\": \"cpu\" (docs/config.md)",
    "gds": "NVMe offload is not implemented; offload to host memory with \"device\": \"cpu\" (docs/config.md)",
    "cpu_adam": "deepspeed.ops.adam.DeepSpeedCPUAdam constructs torch's AdamW/Adam, which steps offloaded state",
    "fused_adam": "deepspeed.ops.adam.FusedAdam constructs torch's AdamW/Adam",
    "cpu_adagrad": "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad constructs torch's Adagrad",
}

# DeepSpeed's builders (class name -> (NAME, BUILD_VAR, base class)), as its op_builder package
# lists them.
_BUILDERS = {
    "AsyncIOBuilder": ("async_io", "DS_BUILD_AIO", TorchCPUOpBuilder),
    "CPUAdagradBuilder": ("cpu_adagrad", "DS_BUILD_CPU_ADAGRAD", TorchCPUOpBuilder),
    "CPUAdamBuilder": ("cpu_adam", "DS_BUILD_CPU_ADAM", TorchCPUOpBuilder),
    "CPULionBuilder": ("cpu_lion", "DS_BUILD_CPU_LION", TorchCPUOpBuilder),
    "DeepCompileBuilder": ("dc", "DS_BUILD_DEEP_COMPILE", TorchCPUOpBuilder),
    "EvoformerAttnBuilder": ("evoformer_attn", "DS_BUILD_EVOFORMER_ATTN", CUDAOpBuilder),
    "FPQuantizerBuilder": ("fp_quantizer", "DS_BUILD_FP_QUANTIZER", CUDAOpBuilder),
    "FusedAdamBuilder": ("fused_adam", "DS_BUILD_FUSED_ADAM", CUDAOpBuilder),
    "FusedLambBuilder": ("fused_lamb", "DS_BUILD_FUSED_LAMB", CUDAOpBuilder),
    "FusedLionBuilder": ("fused_lion", "DS_BUILD_FUSED_LION", CUDAOpBuilder),
    "GDSBuilder": ("gds", "DS_BUILD_GDS", TorchCPUOpBuilder),
    "InferenceBuilder": ("transformer_inference", "DS_BUILD_TRANSFORMER_INFERENCE", CUDAOpBuilder),
    "InferenceCoreBuilder": ("inference_core_ops", "DS_BUILD_INFERENCE_CORE_OPS", CUDAOpBuilder),
    "InferenceCutlassBuilder": ("cutlass_ops", "DS_BUILD_CUTLASS_OPS", CUDAOpBuilder),
    "PinMemoryBuilder": ("pin_memory", "DS_BUILD_PIN_MEMORY", OpBuilder),
    "QuantizerBuilder": ("quantizer", "DS_BUILD_QUANTIZER", CUDAOpBuilder),
    "RaggedOpsBuilder": ("ragged_device_ops", "DS_BUILD_RAGGED_DEVICE_OPS", CUDAOpBuilder),
    "RaggedUtilsBuilder": ("ragged_ops", "DS_BUILD_RAGGED_OPS", CUDAOpBuilder),
    "RandomLTDBuilder": ("random_ltd", "DS_BUILD_RANDOM_LTD", CUDAOpBuilder),
    "SparseAttnBuilder": ("sparse_attn", "DS_BUILD_SPARSE_ATTN", OpBuilder),
    "SpatialInferenceBuilder": ("spatial_inference", "DS_BUILD_SPATIAL_INFERENCE", CUDAOpBuilder),
    "StochasticTransformerBuilder": ("stochastic_transformer", "DS_BUILD_STOCHASTIC_TRANSFORMER", CUDAOpBuilder),
    "TransformerBuilder": ("transformer", "DS_BUILD_TRANSFORMER", CUDAOpBuilder),
    "UtilsBuilder": ("utils", "DS_BUILD_UTILS", OpBuilder),
}


def _builder_class(class_name: str, op_name: str, build_var: str, base: Type[OpBuilder]) -> Type[OpBuilder]:
    def __init__(self):
        base.__init__(self, op_name)

    return type(class_name, (base,), {"NAME": op_name, "BUILD_VAR": build_var, "__init__": __init__,
                                      "__module__": __name__,
                                      "__doc__": f"DeepSpeed's {op_name} op: not built by deepcompile."})


BUILDERS: Dict[str, Type[OpBuilder]] = {
    class_name: _builder_class(class_name, *spec) for class_name, spec in _BUILDERS.items()}
globals().update(BUILDERS)

# DeepSpeed's ``deepspeed.ops.__compatible_ops__``: every op's NAME -> whether it can be loaded
# here, and the extra entry DeepSpeed adds for ops it does not implement.
COMPATIBLE_OPS: Dict[str, bool] = {cls.NAME: cls().is_compatible() for cls in BUILDERS.values()}
COMPATIBLE_OPS["deepspeed_not_implemented"] = False

__all__ = ["OpBuilder", "CUDAOpBuilder", "TorchCPUOpBuilder", *BUILDERS]

__getattr__ = module_getattr("deepspeed.ops.op_builder")
