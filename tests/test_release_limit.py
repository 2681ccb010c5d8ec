"""``compile.max_released_bytes_in_flight``: a bound on the released gathered parameters that the
device may still be reading (csrc ``ReleaseWindow``; its window logic is tested in
tests/cpp/test_lanes.cpp).

The bound only makes the host wait: it changes no kernel and no order on the device, so training
with the tightest bound (1 byte: every release waits for the device's work queued before the
previous one) is bitwise the training without it. On the CPU releases are synchronous and the
setting changes nothing; the GPU case runs the real CUDA events.
"""

from __future__ import annotations

import pytest
import torch

from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import train_engine

WORLD = single_world_size()


def _config(limit: int) -> dict:
    return {"zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
            "compile": {"warmup_steps": 1, "max_released_bytes_in_flight": limit}}


def _body(ctx, backend: str):
    free, _ = train_engine("llama", 4, _config(0), backend, ctx.device)
    bound, engine = train_engine("llama", 4, _config(1), backend, ctx.device)
    engine.destroy()
    assert bound.losses == free.losses, f"{bound.losses} vs {free.losses}"
    for key, value in free.params.items():
        assert torch.equal(bound.params[key], value), key


@pytest.mark.gpu
def test_gpu_release_limit_changes_nothing_but_the_host_lead():
    run_distributed(_body, WORLD, args=("inductor",), timeout=900)


def test_release_limit_is_accepted_and_inert_on_cpu():
    run_distributed(_body, 2, args=("eager",), timeout=600)


def test_release_limit_refuses_negative_bytes():
    from deepcompile.config import Config, ConfigError

    with pytest.raises(ConfigError, match="max_released_bytes_in_flight"):
        Config.from_dict({"zero_optimization": {"stage": 3}, "compile": {"max_released_bytes_in_flight": -1}})
