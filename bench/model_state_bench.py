"""Time and peak memory of a large model's state handling: sharded initialisation from ``meta``,
``save_checkpoint``, ``load_checkpoint`` (into a second engine built on ``meta`` without
``init_fn``) and ``save_hf``, with the disk's own bandwidth (``dd``) measured in the same run.

    torchrun --nproc-per-node 1 bench/model_state_bench.py --dir /tmp/state --markdown bench/results/DATE.md

Defaults: a 7B-class Llama (hidden 4096, 32 layers, intermediate 11008, vocab 32000), bf16
training dtype, ZeRO-3. No training step runs, so the checkpoint holds the fp32 master weights
(the optimizer has no state yet). ``--dir`` must be on the disk being measured and must have room
for the checkpoint (4 bytes per parameter) or the export (2 bytes per parameter); the checkpoint
is deleted before the export. ``--tiny`` runs a small model on CPU (a check of the script).

Per phase: wall time, peak device memory (``max_memory_allocated``, reset at the phase's start),
peak host resident memory (sampled every 20 ms from /proc/self/status) and, for I/O, GB/s of
checkpoint data. The target of issue 17: device peak of init and load at most this rank's shards
plus one parameter.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

GB = 1e9
GIB = 1024**3


class HostPeak:
    """Peak resident set size of this process over a phase, sampled by a thread."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self) -> "HostPeak":
        self.start = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def disk_bandwidth(directory: str, mib: int) -> Dict[str, float]:
    """Sequential write and read GB/s of ``directory``'s disk with direct I/O (dd), bypassing the
    page cache so that the figures are the disk's, not memory's."""
    path = os.path.join(directory, "dd.bin")
    out: Dict[str, float] = {}
    for what, args in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct"]),
                       ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
        start = time.perf_counter()
        subprocess.run(["dd", *args, "bs=4M", f"count={mib // 4}"], check=True, capture_output=True)
        out[what] = mib * 1024**2 / (time.perf_counter() - start) / GB
    os.remove(path)
    return out


def build_meta_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, intermediate_size=args.intermediate,
                      vocab_size=args.vocab, max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model


def ds_config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": not args.tiny},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def phase(name: str, rows: List[dict], device: torch.device, fn: Callable[[], Optional[int]]) -> None:
    """Runs ``fn`` (which returns bytes of checkpoint data it moved, or None) and records a row."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with HostPeak() as host:
        start = time.perf_counter()
        moved = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    dist.barrier()
    rows.append({
        "phase": name, "seconds": seconds,
        "device_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "host_start": host.start, "host_peak": host.peak, "bytes": moved,
    })
    print(f"{name}: {seconds:.1f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", required=True, help="scratch directory on the disk to measure")
    p.add_argument("--dd-mib", type=int, default=4096, help="MiB written and read by the dd measurement")
    p.add_argument("--tiny", action="store_true", help="a small model on CPU (checks the script)")
    p.add_argument("--markdown", help="append the result block to this file")
    args = p.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.intermediate, args.vocab = 64, 2, 4, 128, 256
        args.dd_mib = 8

    import deepcompile

    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.makedirs(args.dir, exist_ok=True)
    ckpt_dir, hf_dir = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "hf")
    for d in (ckpt_dir, hf_dir):
        shutil.rmtree(d, ignore_errors=True)
    rows: List[dict] = []
    bandwidth = disk_bandwidth(args.dir, args.dd_mib) if rank == 0 else {}

    model = build_meta_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    state: dict = {}

    def init():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        state["engine"] = deepcompile.initialize(model, opt, ds_config(args), init_fn=model._init_weights,
                                                 device=device)

    phase("init (meta, init_fn)", rows, device, init)
    engine = state["engine"]
    shard_bytes = sum(s.local.numel() * s.local.element_size() for s in engine.sharding.shards())

    def save():
        engine.save_checkpoint(ckpt_dir, tag="bench")
        return dir_bytes(os.path.join(ckpt_dir, "bench")) if rank == 0 else 0

    phase("save_checkpoint", rows, device, save)
    ckpt_bytes = rows[-1]["bytes"]
    engine.destroy()
    del engine, state["engine"]
    if cuda:
        torch.cuda.empty_cache()

    def load():
        fresh = build_meta_model(args)
        opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
        state["engine"] = deepcompile.initialize(fresh, opt, ds_config(args), device=device)
        state["engine"].load_checkpoint(ckpt_dir)
        unset = list(state["engine"].sharding.unset_params)
        assert not unset, f"parameters still unset after load_checkpoint: {unset[:5]}"
        return ckpt_bytes

    phase("load_checkpoint (meta, no init_fn)", rows, device, load)
    engine = state["engine"]
    if rank == 0:
        shutil.rmtree(ckpt_dir)  # room for the export
    dist.barrier()

    def export():
        engine.save_hf(hf_dir)
        return dir_bytes(hf_dir) if rank == 0 else 0

    phase("save_hf", rows, device, export)
    engine.destroy()
    if rank == 0:
        shutil.rmtree(hf_dir, ignore_errors=True)
        report(args, rows, bandwidth, n_params, largest, shard_bytes, device, world)
    dist.destroy_process_group()


def report(args, rows, bandwidth, n_params, largest, shard_bytes, device, world) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, model state on {world} x {name}",
        "",
        f"- command: `torchrun --nproc-per-node {world} bench/model_state_bench.py --dir {args.dir}`",
        f"- torch {torch.__version__}; model: Llama hidden {args.hidden}, layers {args.layers}, "
        f"intermediate {args.intermediate}, vocab {args.vocab}: {n_params / 1e9:.2f} B parameters; ZeRO-3, "
        f"{'bf16' if not args.tiny else 'fp32'} training dtype, fp32 masters",
        f"- this rank's shards: {shard_bytes / GIB:.2f} GiB; largest parameter: {largest / 1e6:.1f} M elements",
        f"- disk ({args.dir}), dd with direct I/O, {args.dd_mib} MiB: write {bandwidth['write']:.2f} GB/s, "
        f"read {bandwidth['read']:.2f} GB/s",
        "",
        "| phase | time (s) | data (GB) | GB/s | device peak (GiB) | host RSS at start (GiB) | host peak RSS (GiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        data = f"{r['bytes'] / GB:.2f}" if r["bytes"] else ""
        rate = f"{r['bytes'] / GB / r['seconds']:.2f}" if r["bytes"] else ""
        dev = f"{r['device_peak'] / GIB:.2f}" if r["device_peak"] is not None else "n/a"
        lines.append(f"| {r['phase']} | {r['seconds']:.1f} | {data} | {rate} | {dev} | {r['host_start'] / GIB:.2f} | {r['host_peak'] / GIB:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
