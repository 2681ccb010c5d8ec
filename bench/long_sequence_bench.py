"""The longest sequence that trains, and tokens/s at given lengths, with Ulysses sequence
parallelism: deepcompile against DeepSpeed's own Ulysses / ALST route (issue 38's benchmark).

    python3 bench/long_sequence_bench.py [--preset 8b|1b|tiny] [--systems dc,ds-alst]
                                         [--seqs 32768,65536,131072,...] [--search linear|binary]
                                         [--nproc N] [--warmup 1] [--steps 5] [--timeout 600]
                                         [--deadline-s 540] [--dc-compile-set offload_activation=true]
                                         [--json PATH] [--markdown PATH]

Each (system, length) is one try: a ``torchrun --standalone --nproc-per-node N`` child of its own
(this file with ``--worker``), which trains one micro-batch of one sequence of ``--seq`` random
tokens (the same tokens, seed ``--seed``, on every system) for ``--warmup`` steps (the first
compiles) and then ``--steps`` timed steps, and writes one JSON row. A length "trains" when its row
comes back ``ok``; otherwise the row says why (bench/row_process.py): ``OOM`` (device out of
memory, caught in the child), ``killed`` (host out of memory), ``timeout``, ``error``, ``n/a``
(the system is not available here), ``refused`` (the length does not divide by the
sequence-parallel size: DeepSpeed's Ulysses requires it, and deepcompile's padding would train
more tokens than the other system; not launched).

Systems (the sequence-parallel size is the number of ranks, so there is one data-parallel replica):

* ``dc``: deepcompile ZeRO-3, bf16, ``sequence_parallel_size`` = ranks, HF activation checkpointing
  (non-reentrant), ``engine.compile()`` (Inductor on CUDA, eager on CPU); ``--dc-compile-set
  key=value`` entries are merged into the ``compile`` section. The model is built on ``meta`` and
  materialised shard by shard by ``deepcompile.initialize(init_fn=, device=)``.
* ``ds-alst``: DeepSpeed's Ulysses route (``UlyssesSPAttentionHF.register_with_transformers`` with
  SDPA, its ``mpu`` given to ``deepspeed.initialize``), ZeRO-3, bf16, eager, the same activation
  checkpointing; the model built under ``deepspeed.zero.Init``. The batch is sliced as DeepSpeed's
  ``UlyssesSPDataLoaderAdapter`` slices it (input_ids, global position_ids, labels shifted over the
  whole sequence, then sliced) and the loss is weighted over the group as transformers'
  ``deepspeed_sp_compute_loss`` does.
* ``ds-alst-dc``: ``ds-alst`` plus ``"compile": {"deepcompile": true}`` and ``engine.compile()``.
  DeepSpeed 0.19.8 does not refuse DeepCompile with an Ulysses ``mpu`` (its Ulysses all-to-all is a
  registered op with a declared backward so that it traces), so the row is offered; whether it runs
  is what the row says.

DeepSpeed rows run in processes that never import deepcompile (both register the torch op
namespace ``dc``); they are ``n/a`` where ``import deepspeed`` fails. Without CUDA the children use
gloo and the default preset is ``tiny`` (a smoke run, not a measurement).

``--search linear`` (default) tries the lengths in increasing order and stops a system at its first
failure; ``binary`` assumes what fails at S fails above S and bisects the list. ``--deadline-s``
ends the whole run within that many seconds (a try cut short by it counts as not tried).

Columns: ms/step is the median wall time of the timed steps (forward + backward + optimizer step,
bracketed by device synchronisation); tokens/s is global, seq x data-parallel replicas / step
time; peak GiB is the maximum over ranks of ``torch.cuda.max_memory_allocated`` over the whole try
(model build and the compiling step included: the longest sequence is bounded by that).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import row_process  # noqa: E402  (no torch.distributed work at import)
from long_sequence_report import SYSTEMS, markdown, not_run, summarise  # noqa: E402,F401

GIB = 1024**3
DEEPSPEED_SYSTEMS = ("ds-alst", "ds-alst-dc")
# Model shapes as train_bench.py's: 8b its preset (Llama-3-8B), 1b its defaults, tiny for CPU.
# reduce_bucket_size / persistence_threshold: deepcompile's and DeepSpeed's ZeRO-3 settings (train_bench's).
PRESETS: Dict[str, Dict[str, int]] = {
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
               reduce_bucket_size=50_000_000, persistence_threshold=100_000),
    "1b": dict(hidden=2048, layers=16, heads=16, kv_heads=16, intermediate=5632, vocab=32000,
               reduce_bucket_size=50_000_000, persistence_threshold=100_000),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=172, vocab=256,
                 reduce_bucket_size=20_000, persistence_threshold=1_000),
}
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def deepspeed_importable() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def parse_compile_set(items: List[str]) -> Dict[str, object]:
    """``key=value`` entries of ``--dc-compile-set``: values parsed as JSON (true, 0.9, "x"), else strings."""
    out: Dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--dc-compile-set takes key=value, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: 8b with CUDA, tiny without")
    p.add_argument("--systems", default="dc,ds-alst", help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--seqs", default=None, help="comma list of global sequence lengths "
                   "(default: 32768,65536,131072,262144,524288 with CUDA, 64,128 without)")
    p.add_argument("--search", choices=["linear", "binary"], default="linear")
    p.add_argument("--nproc", type=int, default=None, help="ranks per try = sequence-parallel size "
                   "(default: the GPUs, 2 without CUDA)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps, the first compiles (>= 1)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (>= 1)")
    p.add_argument("--backend", choices=["inductor", "eager"], default=None,
                   help="deepcompile's compiler backend (default: inductor with CUDA, eager without)")
    p.add_argument("--dc-compile-set", action="append", default=[], metavar="KEY=VALUE",
                   help="merged into the dc row's compile section (repeatable), e.g. offload_activation=true")
    p.add_argument("--dc-ones-attention-mask", action="store_true",
                   help="dc rows on one rank: pass an all-ones attention_mask, so the causal mask transformers "
                   "traces depends on an input and is kept (the A/B of passes/causal_mask.py)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=600, help="seconds per try")
    p.add_argument("--deadline-s", type=float, default=None, help="the whole run ends within this many seconds")
    p.add_argument("--min-try-s", type=float, default=60, help="no try starts with less than this left")
    p.add_argument("--json", metavar="PATH", help="rewritten after every try")
    p.add_argument("--markdown", metavar="PATH", help="append the tables to PATH")
    # Worker mode (one try, under torchrun): what the driver starts.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-json", metavar="PATH", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = cuda_available()
    args.preset = args.preset or ("8b" if cuda else "tiny")
    args.backend = args.backend or ("inductor" if cuda else "eager")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    try:
        args.compile_set = parse_compile_set(args.dc_compile_set)
    except ValueError as e:
        p.error(str(e))
    if args.worker:
        if args.system not in SYSTEMS or not args.seq or not args.child_json:
            p.error("--worker needs --system, --seq and --child-json")
        return args
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    default_seqs = "32768,65536,131072,262144,524288" if cuda else "64,128"
    try:
        args.seqs = sorted({int(x) for x in (args.seqs or default_seqs).split(",") if x.strip()})
    except ValueError:
        p.error(f"--seqs must be a comma list of integers, got {args.seqs!r}")
    if not args.seqs or args.seqs[0] < 1:
        p.error("--seqs needs at least one length >= 1")
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count() if cuda else 2
    if args.nproc < 1:
        p.error("--nproc must be >= 1")
    return args


# ------------------------------------------------------------------------------------- worker


def model_config(preset: str, seq: int):
    from transformers import LlamaConfig

    s = PRESETS[preset]
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], max_position_embeddings=max(seq, 2048),
                       attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)


def checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def dc_trainer(args, device, world, tokens):
    """deepcompile: ZeRO-3 + sequence_parallel_size = world; returns one training step."""
    import torch
    from transformers import LlamaForCausalLM

    import deepcompile  # only in a dc row's process

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as train_bench's meta build (rotary buffers stay fp32)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config(args.preset, args.seq))
    finally:
        torch.set_default_dtype(old)
    checkpointing(model)
    s = PRESETS[args.preset]
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": s["reduce_bucket_size"],
                                    "stage3_param_persistence_threshold": s["persistence_threshold"]},
              "bf16": {"enabled": True}, "sequence_parallel_size": world, "compile": dict(args.compile_set)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(args.seed)  # init_fn runs from rank 0's generator state
    engine = deepcompile.initialize(model, optimizer, config, init_fn=model._init_weights, device=device)
    engine.compile(backend=args.backend)
    seq = engine.sequence_parallel
    local = seq.shard({"input_ids": tokens, "labels": tokens})
    if args.dc_ones_attention_mask:
        if seq.enabled:
            raise ValueError("--dc-ones-attention-mask: one rank only (sequence parallelism drops every mask)")
        local["attention_mask"] = torch.ones_like(local["input_ids"])

    def step():
        out = engine(**local, use_cache=False)
        loss = seq.loss(out.loss, local.get("shift_labels"))
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine.destroy


def ds_trainer(args, device, world, tokens):
    """DeepSpeed's Ulysses / ALST route (``ds-alst``, ``ds-alst-dc``); returns one training step."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn
    from transformers import LlamaForCausalLM

    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend=dist.get_backend())  # over the group dist_setup made
    s = PRESETS[args.preset]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": s["reduce_bucket_size"],
                                    "stage3_param_persistence_threshold": s["persistence_threshold"]},
              "steps_per_print": 1 << 30}
    if args.system == "ds-alst-dc":
        config["compile"] = {"deepcompile": True}
    torch.manual_seed(args.seed)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = LlamaForCausalLM(model_config(args.preset, args.seq))
    checkpointing(model)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=1, seq_length=args.seq, seq_length_is_variable=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu,
                                      dist_init_required=False)
    if args.system == "ds-alst-dc":
        engine.compile()
        if not engine.is_deepcompile_active():
            raise RuntimeError("DeepSpeed DeepCompile did not start (it fell back to plain torch.compile; its log says why)")
    group = mpu.get_sequence_parallel_group()
    size, rank = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
    # As UlyssesSPDataLoaderAdapter: labels shifted over the whole sequence, then every key sliced.
    chunk = args.seq // size
    part = slice(rank * chunk, (rank + 1) * chunk)
    shifted = torch.nn.functional.pad(tokens, (0, 1), value=-100)[:, 1:]
    positions = torch.arange(args.seq, device=tokens.device).unsqueeze(0)
    local = {"input_ids": tokens[:, part].contiguous(), "position_ids": positions[:, part].contiguous(),
             "shift_labels": shifted[:, part].contiguous()}
    local["labels"] = local["shift_labels"]  # as deepspeed_sp_compute_loss: labels so the model computes a loss

    def step():
        loss = engine(**local, use_cache=False).loss
        # transformers' deepspeed_sp_compute_loss: the slices' means weighted by their valid tokens.
        losses = torch.stack(dist_fn.all_gather(loss, group=group))
        good = (local["shift_labels"] != -100).view(-1).sum()
        counts = torch.stack(dist_fn.all_gather(good, group=group))
        loss = (torch.where(counts > 0, losses, torch.zeros_like(losses)) * counts).sum() / counts.sum()
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine.destroy


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def write_row(path: str, row: Dict[str, object]) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(row, f)
    os.replace(tmp, path)


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from dist_setup import setup

    device, rank, world = setup()
    cuda = device.type == "cuda"
    env = {"device": f"{world} x " + (torch.cuda.get_device_name(device) if cuda else "CPU (gloo)"),
           "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if cuda else "")}
    row: Dict[str, object] = {"system": args.system, "seq": args.seq, "status": "ok", "step_ms": None,
                              "tokens_per_s": None, "peak_gib": None, "first_step_s": None, "loss": None,
                              "note": "", "sp": world, "replicas": 1, "env": env}
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    peak = lambda: torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(args.seed)  # the same tokens on every rank and system
    tokens = torch.randint(0, PRESETS[args.preset]["vocab"], (1, args.seq), generator=g).to(device)
    close = None
    try:
        build = dc_trainer if args.system == "dc" else ds_trainer
        step, close = build(args, device, world, tokens)
        times = []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t0)
        row["loss"] = float(loss.detach().float().item())
        step_s = statistics.median(times[args.warmup:])
        row.update(step_ms=step_s * 1000, tokens_per_s=args.seq * row["replicas"] / step_s, first_step_s=times[0])
    except BaseException as e:  # one rank's failure: its row, then stop the others (torchrun does)
        oom = is_oom(e)
        if not oom:
            traceback.print_exc()
        row.update(status="OOM" if oom else "error", note=" ".join(f"{type(e).__name__}: {e}".split())[:300],
                   peak_gib=peak())
        if not os.path.exists(args.child_json):
            write_row(args.child_json, row)
        sys.stdout.flush()
        os._exit(3)
    peaks = torch.tensor([peak() or 0.0], device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    row["peak_gib"] = float(peaks.item()) if cuda else None
    if rank == 0:
        write_row(args.child_json, row)
    if close is not None:
        close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------- driver


def child_command(args, system: str, seq: int, out: str) -> List[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           os.path.abspath(__file__), "--worker", "--system", system, "--seq", str(seq), "--preset", args.preset,
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--backend", args.backend,
           "--lr", str(args.lr), "--seed", str(args.seed), "--child-json", out]
    if system == "dc":
        for item in args.dc_compile_set:
            cmd += ["--dc-compile-set", item]
        if args.dc_ones_attention_mask:
            cmd.append("--dc-ones-attention-mask")
    return cmd


def run_try(args, system: str, seq: int, timeout: float) -> Dict[str, object]:
    """One (system, seq) in a torchrun child; its row, or a row saying why there is none."""
    env = {k: v for k, v in os.environ.items() if k not in row_process.TORCHRUN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory(prefix="long_seq_") as tmp:
        out = os.path.join(tmp, "row.json")
        t0 = time.monotonic()
        code, tail = row_process.run_streaming(child_command(args, system, seq, out), timeout, env=env)
        seconds = time.monotonic() - t0
        if code is not None and os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                row = json.load(f)
        else:
            status, note = row_process.failure(code, tail, timeout)
            row = {"system": system, "seq": seq, "status": status, "note": note}
    row["seconds"] = seconds
    return row


def next_try(seqs: List[int], results: Dict[int, bool], search: str) -> Optional[int]:
    from largest_model import next_try as next_in_list  # the same search over layer counts

    return next_in_list(seqs, results, search)


def driver(args, argv: List[str]) -> int:
    from largest_model import gpu_names
    from train_bench import git_revision

    start = time.monotonic()
    row_process.stop_children_on_termination()
    import torch

    s = PRESETS[args.preset]
    header: Dict[str, str] = {
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "device": gpu_names() if cuda_available() else f"{args.nproc} x CPU (gloo)",
        "torch": torch.__version__, "deepcompile commit": git_revision(),
        "model": (f"Llama preset {args.preset}: hidden {s['hidden']}, layers {s['layers']}, heads {s['heads']} "
                  f"(kv {s['kv_heads']}), intermediate {s['intermediate']}, vocab {s['vocab']}"),
        "tries": (f"{args.nproc} rank(s) = sequence-parallel size, micro-batch 1, {args.warmup} warm-up + "
                  f"{args.steps} timed steps, {args.timeout:.0f} s limit each; backend {args.backend}"
                  + (f"; dc compile {json.dumps(args.compile_set)}" if args.compile_set else "")
                  + ("; dc given an all-ones attention_mask (the traced causal mask kept)"
                     if args.dc_ones_attention_mask else "")
                  + f"; lengths {','.join(map(str, args.seqs))}, {args.search} search"),
    }
    summaries: List[dict] = []

    def write() -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"header": header, "systems": summaries}, f, indent=1)

    has_deepspeed = deepspeed_importable()
    for system in args.systems:
        rows: List[dict] = []
        splittable = [n for n in args.seqs if n % args.nproc == 0]
        rows += [not_run(system, n, "refused", f"{n} does not divide by sequence_parallel_size {args.nproc}")
                 for n in args.seqs if n % args.nproc]
        if system in DEEPSPEED_SYSTEMS and not has_deepspeed:
            rows += [not_run(system, n, "n/a", "deepspeed is not importable here") for n in splittable]
            splittable = []
        results: Dict[int, bool] = {}
        while (seq := next_try(splittable, results, args.search)) is not None:
            limit = args.timeout
            if args.deadline_s is not None:
                limit = min(limit, args.deadline_s - (time.monotonic() - start))
                if limit < args.min_try_s:
                    print(f"== {system}: deadline, {seq} and beyond not tried", flush=True)
                    break
            print(f"== {SYSTEMS[system]}, seq {seq:,} ({args.nproc} ranks)", flush=True)
            row = run_try(args, system, seq, limit)
            if row["status"] == "timeout" and limit < args.timeout:  # cut by the deadline: unknown, not failed
                print(f"  -> not finished before the deadline ({limit:.0f} s)", flush=True)
                break
            header["device"] = row.get("env", {}).get("device", header["device"])
            row.pop("env", None)
            rows.append(row)
            results[seq] = row["status"] == "ok"
            print(f"  -> {row['status']}" + (f": {row['note']}" if row.get("note") else "")
                  + (f", {row['tokens_per_s']:,.0f} tokens/s" if row.get("tokens_per_s") else "")
                  + f" ({row['seconds']:.0f} s)", flush=True)
            summaries_now = summaries + [summarise(system, sorted(rows, key=lambda r: r["seq"]))]
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump({"header": header, "systems": summaries_now}, f, indent=1)
        summaries.append(summarise(system, sorted(rows, key=lambda r: r["seq"])))
        write()
    header["command"] = "python3 " + shlex.join([os.path.relpath(__file__, REPO_ROOT), *argv])
    write()
    text = markdown(summaries, args.seqs, header)
    print("\n" + text, flush=True)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("the driver starts its own torchrun per try: run it with python3, not under torchrun")
    return driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())
