"""bench/model_state_bench.py end to end on CPU with its tiny preset: one rank builds a model on
meta, initialises, saves, loads into a fresh meta model and exports, and reports one row per
phase (the GPU run of the 7B preset goes into bench/RESULTS.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _harness.paths import ROOT


@pytest.mark.world_size(1)  # torchrun --nproc-per-node 1
def test_model_state_bench_tiny_runs_every_phase(tmp_path):
    out = tmp_path / "result.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29731",
         os.path.join(ROOT, "bench", "model_state_bench.py"), "--tiny", "--dir", str(tmp_path / "scratch"),
         "--markdown", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    phases = [row.split("|")[1].strip() for row in rows[1:]]
    assert phases == ["init (meta, init_fn)", "save_checkpoint", "load_checkpoint (meta, no init_fn)", "save_hf"]
    # The scratch space is cleaned up: neither the checkpoint nor the export is left behind.
    assert sorted(os.listdir(tmp_path / "scratch")) == []
