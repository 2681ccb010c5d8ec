"""Running the Hugging Face examples as their users do (torchrun or ``accelerate launch``, one
fresh process per rank, gloo on CPU), and the single-process plain-PyTorch runs they are compared
with.

The examples set up torch.distributed themselves (through accelerate and deepcompile's
``deepspeed.comm``) and serve deepcompile as ``deepspeed`` for the whole process, so they cannot
run in the pooled ranks of ``multiproc.py``; each launch here is a new set of processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
# examples/hf_trainer.py with test probes around deepspeed.initialize (hf_trainer_probe.py says which)
TRAINER_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_trainer_probe.py")
LAUNCH_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra or {})
    return env


def torchrun(script: str, args: Sequence[str], nproc: int = 2, env: Optional[Dict[str, str]] = None,
             cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script args`` on localhost; raises with the output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), script, *args]
    return run_checked(cmd, env=launch_env(env), cwd=cwd)


def run_trl_worker(worker: str, tmp_path: Any, nproc: int = 2, stage: int = 3) -> Any:
    """Runs a TRL worker of tests/_harness (``--deepspeed``, ``--output-dir``, ``--out``) under
    torchrun with examples/ds_config_zero3.json compiled by the eager backend (``stage=2``: its
    zero_optimization section replaced by a ZeRO-2 one as such configs write it); returns what
    rank 0 wrote to --out. Skips the test where the device cannot host ``nproc`` ranks (one GPU)."""
    from _harness.multiproc import require_world_size

    require_world_size(nproc)
    with open(os.path.join(EXAMPLES, "ds_config_zero3.json")) as f:
        config = json.load(f)
    config["compile"] = {"backend": "eager"}
    if stage == 2:
        config["zero_optimization"] = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8}
    elif stage != 3:
        raise ValueError(f"run_trl_worker: stage 2 or 3, got {stage}")
    ds_config = os.path.join(str(tmp_path), "ds_config.json")
    with open(ds_config, "w") as f:
        json.dump(config, f)
    out = os.path.join(str(tmp_path), "out.json")
    torchrun(os.path.join(os.path.dirname(os.path.abspath(__file__)), worker),
             ["--deepspeed", ds_config, "--output-dir", os.path.join(str(tmp_path), "o"), "--out", out], nproc=nproc)
    return read_json(out)


def run_checked(cmd: List[str], env: Dict[str, str], cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-12000:]}")
    return proc


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def examples_module(name: str):
    """Import a helper module of examples/ (hf_tiny) without running any example script."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    return __import__(name)


def accelerate_reference(rows: int, micro_batch: int, accumulation: int, world_size: int, lr: float,
                         max_grad_norm: float = 1.0, epochs: int = 1) -> Dict[str, List[float]]:
    """examples/hf_accelerate.py's training in one process with plain PyTorch, on the same global
    batches: micro-step k of the distributed run sees rows [k*W*mb, (k+1)*W*mb) split over the W
    ranks (accelerate hands rank r every W-th batch of the loader), the gradient is averaged over
    them and the window (a last, shorter window as DeepSpeed does it), clipped to max_grad_norm (accelerate fills DeepSpeed's "auto" clipping
    with 1.0), and the schedule steps W times per optimizer step (accelerate's
    AcceleratedScheduler, since each step consumed W loader batches)."""
    from transformers import get_linear_schedule_with_warmup

    tiny = examples_module("hf_tiny")
    model = tiny.build_model(seed=0)
    data = tiny.token_rows(rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = epochs * (rows // micro_batch) // accumulation
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=total)
    global_batch = micro_batch * world_size
    batches = rows // global_batch  # per rank (the loader's batches split over the ranks)
    losses, lrs = [], []
    for first in [f for _ in range(epochs) for f in range(0, batches, accumulation)]:
        # A last window of fewer micro-batches ends at the end of the loader; DeepSpeed still
        # divides each loss by gradient_accumulation_steps.
        window = []
        for k in range(first, min(first + accumulation, batches)):
            batch = data[k * global_batch:(k + 1) * global_batch]
            loss = model(input_ids=batch, labels=batch).loss
            (loss / accumulation).backward()
            window.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        for _ in range(world_size):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(sum(window) / len(window))
        lrs.append(scheduler.get_last_lr()[0])
    return {"losses": losses, "lrs": lrs}
