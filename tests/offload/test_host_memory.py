"""Host buffers for offloaded state (deepcompile/offload/host_memory.py): pinned ones are exactly
the size asked for (torch's pinned allocator would round them up to a power of two)."""

from __future__ import annotations

import pytest
import torch

from deepcompile.offload import host_memory


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_pageable_buffer_is_exact_and_separate():
    a = host_memory.empty_host(1000, pin=False)
    b = host_memory.empty_host(1000, pin=False)
    assert a.dtype == torch.uint8 and a.numel() == 1000 and a.device.type == "cpu"
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_pinned_buffer_without_a_gpu_is_a_clear_error():
    # No CUDA device (or a build without CUDA): nothing can be page-locked for a device, and the
    # offload planner must learn it as its own error type (it is raised on every rank).
    with pytest.raises(host_memory.PinnedMemoryError, match="could not allocate 4096 bytes of pinned host memory"):
        host_memory.empty_host(4096, pin=True)


@pytest.mark.gpu
def test_pinned_buffer_is_exact_and_copies_asynchronously():
    # 180 MB: the size of one fp32 Adam moment of a 4096 x 11008 weight, which torch's pinned
    # allocator would place in a 256 MiB block.
    n = 4096 * 11008 * 4
    # The CUDA context and the driver's own first pinned allocation cost ~100 MB of the process's
    # memory (seen on the H100): pay them before measuring.
    torch.cuda.init()
    torch.empty(1, device="cuda")
    host_memory.empty_host(4096, pin=True)  # freed at once
    before = _rss_bytes()
    host = host_memory.empty_host(n, pin=True)
    grown = _rss_bytes() - before
    assert host.numel() == n
    # Page-locking touches every page: the process holds the buffer's pages, and not a rounded
    # block (2 MiB of slack for the allocator's own bookkeeping and other threads).
    assert n <= grown + (2 << 20) and grown <= n + (2 << 20), (n, grown)
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    device.random_(0, 256)
    torch.cuda.synchronize()
    # The driver copies from page-locked memory asynchronously: right after the launch a 180 MB
    # copy (at least 3 ms over any PCIe or C2C link) is still running on its stream; a copy from
    # pageable memory would have returned only when done. (torch's is_pinned() does not know
    # buffers it did not allocate itself, so it is not the check.)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        host.copy_(device, non_blocking=True)
        still_running = not stream.query()
        back = torch.empty_like(device)
        back.copy_(host, non_blocking=True)
    stream.synchronize()
    assert still_running, "the device-to-host copy into the pinned buffer ran synchronously"
    assert torch.equal(back, device)
    del host  # freed with its storage (cudaFreeHost): the pages go back
    assert _rss_bytes() < before + grown // 2
