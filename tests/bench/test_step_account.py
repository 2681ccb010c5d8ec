"""bench/step_account.py: kernels fall into the kinds by name, the device's idle time is the traced
span minus the union of its events (overlapping streams counted once), and per-step numbers divide
by the steps; the CLI prints two traces side by side."""

from __future__ import annotations

import gzip
import json
import os
import sys

from _harness.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import step_account  # noqa: E402


def _trace():
    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    return {"traceEvents": [
        x("cpu_op", "aten::mm", 0, 10),
        x("cuda_runtime", "cudaLaunchKernel", 1, 2),
        x("cuda_runtime", "cudaLaunchKernel", 3, 2),
        x("cpu_op", "dc::allgather_param", 5, 4),
        x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 10, 40),
        x("kernel", "ncclDevKernel_AllGather_RING_LL", 30, 30),  # overlaps the GEMM
        x("kernel", "pytorch_flash::flash_fwd_kernel", 70, 10),
        x("kernel", "multi_tensor_apply_kernel<AdamFunctor>", 80, 5),
        x("kernel", "triton_poi_fused_add_0", 85, 5),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 90, 5),
        x("kernel", "elementwise_kernel", 195, 5),
        {"ph": "i", "name": "marker", "ts": 300},  # no duration: not counted
    ]}


def test_lambda_in_a_kernel_name_is_not_an_optimizer():
    assert step_account.classify("reduce_kernel<128, 4, ReduceOp<float, func_wrapper<[lambda]>>>") == "other"
    assert step_account.classify("multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"


def test_kinds_busy_idle_and_host():
    acc = step_account.account(_trace(), steps=2)
    assert acc["device: GEMM"] == 0.02 and acc["device: collectives"] == 0.015
    assert acc["device: attention"] == 0.005 and acc["device: optimizer"] == 0.0025
    assert acc["device: inductor fused"] == 0.0025 and acc["device: copies/sets"] == 0.0025
    assert acc["device: other"] == 0.0025
    # union: [10, 60) + [70, 95) + [195, 200) = 80 us; span [0, 200) = 200 us
    assert acc["device busy (union)"] == 0.04 and acc["device idle"] == 0.06 and acc["traced span"] == 0.1
    assert acc["host: kernel launches (count)"] == 1 and acc["host: in launch calls"] == 0.002
    assert acc["host: in dc:: runtime ops"] == 0.002


def test_cli_prints_traces_side_by_side(tmp_path, capsys):
    paths = []
    for name in ("engine", "trainer"):
        path = tmp_path / f"{name}.trace.json.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(_trace(), f)
        paths.append(str(path))
    assert step_account.main([paths[0], paths[1] + ":1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-2:] == ["engine", "trainer"]
    gemm = next(line for line in out if line.startswith("device: GEMM")).split()
    assert gemm[-2:] == ["0.02", "0.04"]  # two steps against one
