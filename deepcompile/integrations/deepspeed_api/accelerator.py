"""``deepspeed.accelerator.get_accelerator()``: the device queries transformers makes through it."""

from __future__ import annotations

import torch

from deepcompile.integrations.deepspeed_api._missing import missing
from deepcompile.integrations.deepspeed_api.comm import get_local_rank


class _Accelerator:
    """CUDA when present, else the CPU (the device deepcompile trains on in that process)."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()

    def device_name(self, device_index=None) -> str:
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def current_device(self):
        return torch.cuda.current_device() if self._cuda else "cpu"

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_available(self) -> bool:
        return True

    def local_rank_device(self) -> torch.device:
        return torch.device("cuda", get_local_rank()) if self._cuda else torch.device("cpu")

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def __getattr__(self, name: str):
        raise missing(f"deepspeed.accelerator.get_accelerator().{name}")


_ACCELERATOR = None


def get_accelerator() -> _Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = _Accelerator()
    return _ACCELERATOR
