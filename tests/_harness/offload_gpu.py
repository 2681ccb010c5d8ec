"""The run both GPU offload tests share (tests/offload/test_offload.py, tests/offload/test_param_offload.py).

A stack of Linear layers (tests/memory/test_gpu_memory.py) is trained with Inductor twice, without and
with an offload config; each run returns its losses, its full parameters and the device memory
settled after step ``early`` and after the last step. An offload run also brings back the units a
test's check names after step ``early`` and reads that the allocator holds exactly their blocks
more. Then: bitwise parity (offload moves bytes only), no growth from step ``early`` to the last,
and at least the moved bytes less device memory than without offload.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

GPU_SIZES = dict(width=1024, depth=6, batch=64)

Run = Tuple[torch.Tensor, Dict[str, torch.Tensor], Dict[Any, int]]


def device_memory(ctx):
    """The allocator readings of ``ctx``'s device, once cuBLAS is warmed up (both runs read it)."""
    from test_gpu_memory import DeviceMemory, warm_up_cublas

    warm_up_cublas(GPU_SIZES["width"], GPU_SIZES["batch"], torch.float32, ctx.device)
    return DeviceMemory(ctx.device)


def train_and_read(ctx, mem, zero: Dict[str, Any], steps: int, early: int,
                   at_early: Optional[Callable[[Any], List[Any]]] = None, no_sync_step: Optional[int] = None) -> Run:
    """Train under ``zero`` (zero_optimization keys over the shared ones), reading ``mem``
    (``device_memory``). ``at_early(engine)``
    checks the engine after step ``early`` and returns the offload units moved off the device.
    ``no_sync_step``: the micro-step whose ``engine.step()`` runs with CUDA's sync debug mode on
    "error" (a planned step never waits on the host)."""
    import deepcompile
    from test_gpu_memory import build_model, make_batch, make_optimizer

    width, depth, bsz = GPU_SIZES["width"], GPU_SIZES["depth"], GPU_SIZES["batch"]
    torch._dynamo.reset()
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": width * width + width,
                                 **zero},
           # Profile-guided passes off: the same schedule at every step of both runs.
           "compile": {"prefetch": False, "selective_gather": False}}
    model = build_model(width, depth, torch.float32, ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
    engine.compile(backend="inductor")
    rank, world = dist.get_rank(), dist.get_world_size()
    readings, losses = {}, []
    for step in range(steps):
        x, y = make_batch(step, bsz * world, width, torch.float32, ctx.device)
        loss = engine(x[rank * bsz:(rank + 1) * bsz], y[rank * bsz:(rank + 1) * bsz])
        engine.backward(loss)
        if step == no_sync_step:
            # Any synchronising CUDA call in the step raises here.
            torch.cuda.set_sync_debug_mode("error")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            engine.step()
        # On the host: a device copy per step would itself grow memory between the readings.
        losses.append(loss.detach().cpu())
        if step + 1 in (early, steps):
            readings[step + 1] = mem.settle()
        if at_early is not None and step + 1 == early:
            moved = at_early(engine)
            # Device memory between steps lacks exactly the moved units: bring them back and the
            # allocator holds exactly their blocks more.
            engine.offload.materialize()
            back = mem.settle()
            readings["moved_blocks"] = mem.bytes_of([u.device_bytes for u in moved])
            readings["moved_bytes"] = sum(u.nbytes for u in moved)
            assert back - readings[early] == readings["moved_blocks"], (back, readings)
    params = {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}
    engine.destroy()
    return torch.stack(losses).float(), params, readings


def assert_parity_and_memory(base: Run, got: Run, steps: int, early: int) -> None:
    """``got`` (the offload run) against ``base`` (the same run without offload)."""
    base_losses, base_params, base_mem = base
    losses, params, got_mem = got
    # Offload moves bytes only: same kernels on the same values, so the same bits.
    assert torch.equal(losses, base_losses), (losses, base_losses)
    for key, value in base_params.items():
        assert torch.equal(params[key], value), key
    # No growth: what is offloaded leaves the device after every step, it does not accumulate.
    assert got_mem[steps] == got_mem[early], got_mem
    # And it is really absent: at least the moved bytes below the run without offload.
    assert base_mem[early] - got_mem[early] >= got_mem["moved_bytes"], (base_mem, got_mem)
