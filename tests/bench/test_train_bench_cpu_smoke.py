"""bench/README.md's CPU smoke run of train_bench.py, exactly as documented: two gloo ranks under
torchrun, every default method of the tiny preset. It must exit 0 with a timed row for each method
(tests/project/test_documented_commands.py names this test as the command's coverage)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from _harness.paths import ROOT

COMMAND = "torchrun --nproc-per-node 2 bench/train_bench.py --preset tiny --warmup 3 --steps 2"
METHODS = ("deepcompile ZeRO-3", "deepcompile ZeRO-3 + prefetch", "deepcompile ZeRO-3 + prefetch + selective",
           "deepcompile ZeRO-1", "deepcompile ZeRO-2", "FSDP2 + compile", "DDP + compile")


@pytest.mark.world_size(2)
def test_train_bench_cpu_smoke_runs_as_documented():
    with open(os.path.join(ROOT, "bench", "README.md"), encoding="utf-8") as f:
        assert COMMAND in f.read(), "bench/README.md no longer documents this command: update COMMAND"
    args = [sys.executable, "-m", "torch.distributed.run", *COMMAND.split()[1:]]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU form, even on a GPU machine
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for method in METHODS:
        # a row that starts with the method's name and gives a step time in ms
        row = re.search(rf"^{re.escape(method)}(?: \(run \d\))?\s+(\d+(?:\.\d+)?)\s", done.stdout, re.M)
        assert row and float(row.group(1)) > 0, f"no timed row for {method!r}:\n{done.stdout[-3000:]}"
