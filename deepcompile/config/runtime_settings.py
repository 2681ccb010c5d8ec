"""The config as the C++ runtime takes it (``deepcompile.runtime.RuntimeConfig``)."""

from __future__ import annotations

from typing import Any, Dict

from deepcompile.config import rules
from deepcompile.config.errors import is_auto


def runtime_config(config) -> Dict[str, Any]:
    """Keyword arguments for :class:`deepcompile.runtime.RuntimeConfig` (the config imports nothing
    of the runtime; tests/config/test_config.py checks that the keys are exactly RuntimeConfig's fields)."""
    c = config.compile
    if is_auto(config.zero_optimization.reduce_bucket_size):
        raise ValueError("zero_optimization.reduce_bucket_size is still \"auto\": resolve the config "
                         "(Config.resolve) before building the runtime settings")
    double_buffer, sync_after_reduce = rules.reduce_overlap(config)
    kwargs = {
        "reduce_bucket_size": config.zero_optimization.reduce_bucket_size,
        "double_buffer": double_buffer,
        "free_activation_threshold": c.free_activation_threshold,
        "sync_before_reduce": c.sync_before_reduce,
        "sync_after_reduce": sync_after_reduce,
        "sync_before_allgather": c.sync_before_allgather,
        "sync_after_allgather": c.sync_after_allgather,
    }
    return kwargs
