"""How long an all-gather takes, by size: measured once, then interpolated.

``measure_allgather`` times ``all_gather_into_tensor`` over the group for a ladder of per-rank
sizes (bf16 elements on GPU, fp32 on CPU), a few trials each after a warm-up, and takes the MAX
over ranks so every rank holds the same model. :class:`CommModel` predicts the time of a gather of
any size by piecewise-linear interpolation between the measured points (linear extrapolation
above the largest, zero for zero bytes): no scipy needed.

The planners use it to decide which gathers to fuse (a fused launch pays the fixed latency once)
and what re-gathering a parameter costs (selective unsharding).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


@dataclasses.dataclass
class CommModel:
    """Measured all-gather times: ``points`` of (bytes gathered per rank, milliseconds)."""

    points: List[Tuple[int, float]]

    def predict_ms(self, nbytes: int) -> float:
        """Time to all-gather a parameter whose shard is ``nbytes / world`` bytes per rank.

        ``nbytes`` is the size of the *gathered* (full) tensor, as the planners see parameters.
        """
        if nbytes <= 0 or not self.points:
            return 0.0
        xs = [p[0] for p in self.points]
        ys = [p[1] for p in self.points]
        if nbytes <= xs[0]:
            return ys[0]  # latency floor
        i = bisect.bisect_left(xs, nbytes)
        if i >= len(xs):
            i = len(xs) - 1  # extrapolate along the last segment
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
        return max(y0 + slope * (nbytes - x0), ys[0])

    def to_dict(self):
        return {"points_bytes_ms": [[int(b), round(float(t), 5)] for b, t in self.points]}


def _sizes(device: torch.device, max_bytes: Optional[int]) -> List[int]:
    # Full-tensor byte sizes: 64 KiB .. 256 MiB on GPU, 4 KiB .. 4 MiB on CPU (gloo is slow).
    lo, hi = (12, 22) if device.type == "cpu" else (16, 28)
    sizes = [1 << p for p in range(lo, hi + 1, 2)]
    if max_bytes is not None:
        sizes = [s for s in sizes if s <= max_bytes] or sizes[:1]
    return sizes


def measure_allgather(group: Optional[dist.ProcessGroup], device: torch.device, trials: int = 3,
                      max_bytes: Optional[int] = None, sizes: Optional[Sequence[int]] = None, *,
                      agree_group: Optional[dist.ProcessGroup] = None) -> CommModel:
    """Time all-gathers of several sizes on ``group`` (the ranks parameters are gathered over: a
    shard group under hybrid sharding); every rank of ``agree_group`` (default: ``group``) gets
    the same (MAX) model, so that ranks whose plans must match plan from the same numbers."""
    world = dist.get_world_size(group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    points: List[Tuple[int, float]] = []
    for nbytes in list(sizes) if sizes is not None else _sizes(device, max_bytes):
        per_rank = max(1, nbytes // dtype.itemsize // world)
        shard = torch.ones(per_rank, dtype=dtype, device=device)
        full = torch.empty(per_rank * world, dtype=dtype, device=device)
        dist.all_gather_into_tensor(full, shard, group=group)  # warm-up (and connection setup)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(trials):
                dist.all_gather_into_tensor(full, shard, group=group)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / trials
        else:
            t0 = time.perf_counter()
            for _ in range(trials):
                dist.all_gather_into_tensor(full, shard, group=group)
            ms = (time.perf_counter() - t0) * 1e3 / trials
        points.append((per_rank * world * dtype.itemsize, ms))
        del shard, full
    times = torch.tensor([t for _, t in points], dtype=torch.float64,
                         device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=agree_group if agree_group is not None else group)
    points = [(b, t) for (b, _), t in zip(points, times.cpu().tolist())]
    # Keep the curve non-decreasing: noise must not make a larger gather look cheaper.
    for i in range(1, len(points)):
        points[i] = (points[i][0], max(points[i][1], points[i - 1][1]))
    return CommModel(points)
