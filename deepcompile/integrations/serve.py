"""``deepcompile.serve_as_deepspeed()``: make ``import deepspeed`` return deepcompile's
implementation (``deepspeed_api``), so that transformers and accelerate, which reach DeepSpeed
only through that import and its package metadata, run their DeepSpeed code unchanged on
deepcompile.

Three things make them see DeepSpeed: the modules in ``sys.modules`` under ``deepspeed`` and
``deepspeed.*``; a distribution named ``deepspeed`` for ``importlib.metadata`` (both libraries
check it before they use the package, and compare its version); and, on a machine without GPU,
accelerate's backend choice (``accelerate_cpu.py``). Any other ``deepspeed.*`` module fails to
import with a message naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys
from typing import Dict

_PACKAGE = "deepcompile.integrations.deepspeed_api"
# deepspeed module name -> deepcompile module that implements it.
_MODULES: Dict[str, str] = {
    "deepspeed": _PACKAGE,
    "deepspeed.comm": _PACKAGE + ".comm",
    "deepspeed.zero": _PACKAGE + ".zero",
    "deepspeed.utils": _PACKAGE + ".utils",
    "deepspeed.utils.logging": _PACKAGE + ".ds_logging",  # utils.py is a module: its `logging` names it
    "deepspeed.utils.zero_to_fp32": _PACKAGE + ".zero_to_fp32",  # likewise, utils.py's `zero_to_fp32`
    "deepspeed.utils.groups": _PACKAGE + ".ds_groups",  # likewise, utils.py's `groups`
    "deepspeed.checkpointing": _PACKAGE + ".checkpointing",
    "deepspeed.compression": _PACKAGE + ".compression",
    "deepspeed.compression.helper": _PACKAGE + ".compression.helper",
    "deepspeed.accelerator": _PACKAGE + ".accelerator",
    "deepspeed.runtime": _PACKAGE + ".runtime",
    "deepspeed.runtime.lr_schedules": _PACKAGE + ".runtime.lr_schedules",
    "deepspeed.runtime.zero": _PACKAGE + ".runtime.zero",
    "deepspeed.runtime.zero.partition_parameters": _PACKAGE + ".runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.offload_config": _PACKAGE + ".runtime.zero.offload_config",
    "deepspeed.runtime.engine": _PACKAGE + ".runtime.engine",
    "deepspeed.runtime.base_optimizer": _PACKAGE + ".runtime.base_optimizer",
    "deepspeed.runtime.sequence_parallel": _PACKAGE + ".runtime.sequence_parallel",
    "deepspeed.runtime.sequence_parallel.ulysses_sp": _PACKAGE + ".runtime.sequence_parallel.ulysses_sp",
    "deepspeed.runtime.fp16": _PACKAGE + ".runtime.fp16",
    "deepspeed.runtime.fp16.onebit": _PACKAGE + ".runtime.fp16.onebit",
    "deepspeed.runtime.fp16.onebit.adam": _PACKAGE + ".runtime.fp16.onebit.adam",
    "deepspeed.runtime.fp16.onebit.lamb": _PACKAGE + ".runtime.fp16.onebit.lamb",
    "deepspeed.runtime.fp16.onebit.zoadam": _PACKAGE + ".runtime.fp16.onebit.zoadam",
    "deepspeed.checkpoint": _PACKAGE + ".checkpoint",
    "deepspeed.checkpoint.utils": _PACKAGE + ".checkpoint.utils",
    "deepspeed.ops": _PACKAGE + ".ops",
    "deepspeed.ops.adam": _PACKAGE + ".ops.adam",
    "deepspeed.ops.adagrad": _PACKAGE + ".ops.adagrad",
    "deepspeed.ops.lamb": _PACKAGE + ".ops.lamb",
    "deepspeed.ops.aio": _PACKAGE + ".ops.aio",
    "deepspeed.ops.op_builder": _PACKAGE + ".ops.op_builder",
    "deepspeed.launcher": _PACKAGE + ".launcher",
    "deepspeed.launcher.runner": _PACKAGE + ".launcher.runner",
}


class _Distribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution's metadata: its name and the API version served."""

    def __init__(self, version: str):
        self._metadata = (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n"
                          "Summary: DeepSpeed's interface served by deepcompile (deepcompile.serve_as_deepspeed)\n")

    def read_text(self, filename):
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path):
        raise FileNotFoundError(path)


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: refuses ``deepspeed.*`` modules deepcompile does not provide
    (never falling through to an installed DeepSpeed), and answers metadata for ``deepspeed``."""

    def __init__(self, version: str):
        self.version = version

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname in _MODULES:  # served from sys.modules; reached only if someone removed it there
            return importlib.util.find_spec(_MODULES[fullname])
        raise ModuleNotFoundError(
            f"deepcompile does not implement the module {fullname} (deepcompile.serve_as_deepspeed() provides "
            "only the part of DeepSpeed that Hugging Face Trainer and accelerate use; docs/huggingface.md)",
            name=fullname)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == "deepspeed":
            yield _Distribution(self.version)


def _check_not_too_late() -> None:
    """transformers and accelerate decide at import time whether DeepSpeed is there."""
    tf = sys.modules.get("transformers.integrations.deepspeed")
    if tf is not None and getattr(tf, "DeepSpeedConfig", None) is object:
        raise RuntimeError("deepcompile.serve_as_deepspeed() must run before transformers' Trainer or models are "
                           "imported (transformers.integrations.deepspeed already decided DeepSpeed is absent)")
    acc = sys.modules.get("accelerate.accelerator")
    if acc is not None and not hasattr(acc, "DeepSpeedEngineWrapper"):
        raise RuntimeError("deepcompile.serve_as_deepspeed() must run before accelerate is imported "
                           "(accelerate.accelerator already decided DeepSpeed is absent)")


def serve_as_deepspeed() -> None:
    """Serve deepcompile as the ``deepspeed`` package in this process. Call it once, at the top
    of the training script, before importing transformers' Trainer or accelerate; then run the
    script unchanged with its DeepSpeed config. Idempotent. Refuses if the real DeepSpeed is
    already imported (its engine and deepcompile's cannot share the process)."""
    current = sys.modules.get("deepspeed")
    if current is not None:
        if getattr(current, "__name__", None) == _PACKAGE:
            return
        raise RuntimeError("deepcompile.serve_as_deepspeed(): the real deepspeed package is already imported in this "
                           "process; call serve_as_deepspeed() before anything imports deepspeed")
    _check_not_too_late()
    for ds_name, dc_name in _MODULES.items():
        sys.modules[ds_name] = importlib.import_module(dc_name)
    sys.meta_path.insert(0, _Finder(sys.modules["deepspeed"].__version__))
    from deepcompile.integrations import accelerate_cpu

    accelerate_cpu.install()
