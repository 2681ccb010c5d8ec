"""``deepspeed.accelerator.get_accelerator()`` (also ``deepspeed.get_accelerator``): the device
queries and settings transformers, DeepSpeed-Chat and DeepSpeedExamples make through it.

CUDA when present, else the CPU, the device deepcompile trains on in that process. On the CPU
each call does what it means there: device settings are no-ops (one device, nothing to select
or flush), seeds go to torch's CPU generator, and memory figures are the host's (this process's
resident set; the machine's total and available memory), so that the memory reports training
scripts log stay meaningful.
"""

from __future__ import annotations

import os

import torch

from deepcompile.integrations.deepspeed_api._missing import missing
from deepcompile.integrations.deepspeed_api.comm import get_local_rank


def _resident_bytes() -> int:
    import psutil  # accelerate's dependency; needed only for CPU memory figures

    return int(psutil.Process().memory_info().rss)


class _Accelerator:
    """CUDA when present, else the CPU (the device deepcompile trains on in that process)."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        # CPU: the largest resident set seen since the last reset (there is no allocator counter
        # to ask); sampled whenever a memory figure is read.
        self._cpu_peak = 0

    # ---- names and selection --------------------------------------------------------------

    def device_name(self, device_index=None) -> str:
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def current_device(self):
        return torch.cuda.current_device() if self._cuda else "cpu"

    def set_device(self, device_index) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        # Every local rank computes on the host; scripts index "devices" by local rank
        # (local_rank % device_count()), so there are as many as ranks on this host.
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_available(self) -> bool:
        return True

    def local_rank_device(self) -> torch.device:
        return torch.device("cuda", get_local_rank()) if self._cuda else torch.device("cpu")

    # ---- random seeds -----------------------------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    # ---- synchronisation and memory -----------------------------------------------------------

    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        now = _resident_bytes()
        self._cpu_peak = max(self._cpu_peak, now)
        return now

    def max_memory_allocated(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return max(self._cpu_peak, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._cpu_peak = _resident_bytes()

    def total_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        import psutil

        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index=None) -> int:
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return int(free)
        import psutil

        return int(psutil.virtual_memory().available)

    # ---- precisions -----------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        # deepcompile trains fp16 (with its loss scaler) on the CPU as well, over gloo.
        return True

    def __getattr__(self, name: str):
        raise missing(f"deepspeed.accelerator.get_accelerator().{name}")


_ACCELERATOR = None


def get_accelerator() -> _Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = _Accelerator()
    return _ACCELERATOR
