"""The random number generators a training step may draw from, per rank: torch's CPU generator,
the CUDA generator of the engine's device (where there is one), Python's ``random`` and numpy's
global generator (where numpy is installed)."""

from __future__ import annotations

import random
from typing import Any, Dict

import torch


def capture(device: torch.device) -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy
    except ImportError:
        pass
    else:
        state["numpy"] = numpy.random.get_state()
    return state


def restore(state: Dict[str, Any], device: torch.device) -> None:
    """Set every generator ``state`` has and this process uses; the others are left as they are
    (a CUDA state saved on GPUs is not applied on CPU, and the reverse)."""
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    if "torch_cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["torch_cuda"], device)
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        numpy.random.set_state(state["numpy"])
