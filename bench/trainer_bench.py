"""The paths users train through: Hugging Face Trainer and an accelerate loop, on deepcompile and on
DeepSpeed, with the same model, data and DeepSpeed config, each row in a process of its own.

    python3 bench/trainer_bench.py --nproc 2 [--preset 1b|8b|tiny] [--rows dc,ds-dc,...]
                                   [--precision bf16|fp16] [--accumulation 1] [--warmup 10] [--steps 30]
                                   [--json PATH] [--markdown PATH]

Every row runs an ordinary training script, as a user writes it: ``TrainingArguments(bf16=True,
max_grad_norm=1.0, ...)`` (or ``fp16``), ``examples/ds_config_zero3.json`` with its ``"auto"``
values and ``"compile": {"deepcompile": true}``, then ``AutoModelForCausalLM.from_config`` (a
Llama; under Trainer's ZeRO-3 it is built inside ``deepspeed.zero.Init``), random token ids
(labels = inputs), ``Trainer.train()``. The deepcompile rows put ``deepcompile.serve_as_deepspeed()``
first; the DeepSpeed rows import the real DeepSpeed (``scripts/fetch_deepspeed_wheels.sh``), so the
two never share a process.

Rows (``--rows``):

* ``dc``: deepcompile, Trainer with ``torch_compile=True`` (the script of issue 37);
* ``dc-noflag``: deepcompile, Trainer without ``torch_compile`` (compiled by default,
  ``compile.auto_compile``);
* ``dc-eager``: deepcompile, ``"auto_compile": false``: the uncompiled path (eager ZeRO hooks);
* ``ds-dc``: DeepSpeed DeepCompile, Trainer with ``torch_compile=True``;
* ``ds-z3``: DeepSpeed ZeRO-3, eager (Trainer without ``torch_compile``);
* ``acc-dc`` / ``acc-ds-dc``: an accelerate loop (``Accelerator(deepspeed_plugin=...,
  dynamo_backend="inductor")``, ``prepare``, ``backward``, ``step``; the model built plainly, not
  under ``zero.Init``) on deepcompile / on DeepSpeed DeepCompile.

Columns, per rank (time and memory the maximum over ranks): step time, the median over the
measured optimizer steps of the wall time between consecutive step ends (each end synchronises the
device), data loading and Trainer's logging included, as a user sees them; tokens/s per GPU; peak
``max_memory_allocated`` over the measured steps; "first step": seconds from process start to the
end of the first optimizer step (model build, ``initialize``, the first compile); "scheduled":
seconds to the end of the warm-up, by which both engines run their profile-guided schedule (both
re-plan at step 5); the losses of every step (Trainer's logged loss; the accelerate rows: the mean
over ranks). The table compares each row with ``ds-dc`` and the losses with the first DeepSpeed row.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DS_CONFIG = os.path.join(ROOT, "examples", "ds_config_zero3.json")

# row key -> (label, engine, loop, torch_compile, extra "compile" keys)
ROWS: Dict[str, tuple] = {
    "dc": ("deepcompile, Trainer, torch_compile=True", "deepcompile", "trainer", True, {}),
    "dc-noflag": ("deepcompile, Trainer, torch_compile off (compiled by default)", "deepcompile", "trainer", False, {}),
    "dc-eager": ("deepcompile, Trainer, auto_compile false (uncompiled)", "deepcompile", "trainer", False,
                 {"auto_compile": False}),
    "ds-dc": ("DeepSpeed DeepCompile, Trainer, torch_compile=True", "deepspeed", "trainer", True, {}),
    "ds-z3": ("DeepSpeed ZeRO-3, Trainer, torch_compile off (eager)", "deepspeed", "trainer", False, {}),
    "acc-dc": ("deepcompile, accelerate loop, dynamo inductor", "deepcompile", "accelerate", True, {}),
    "acc-ds-dc": ("DeepSpeed DeepCompile, accelerate loop, dynamo inductor", "deepspeed", "accelerate", True, {}),
}
PRESETS = {
    "1b": dict(hidden=2048, layers=16, heads=16, kv_heads=16, intermediate=5632, vocab=32000, seq=2048, micro_batch=2),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, seq=2048,
               micro_batch=1),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=172, vocab=256, seq=64, micro_batch=2),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="dc,dc-noflag,dc-eager,ds-dc,ds-z3")
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--micro-batch", type=int, help="default: the preset's")
    p.add_argument("--precision", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--warmup", type=int, default=10, help="optimizer steps before the measured ones")
    p.add_argument("--steps", type=int, default=30, help="measured optimizer steps")
    p.add_argument("--backend", choices=["inductor", "eager"], default="inductor",
                   help="the compiler of every compiled row (eager: CPU smoke runs)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="set a key of the DeepSpeed config every row gets (dotted, JSON value), e.g. "
                        "zero_optimization.reduce_bucket_size=50000000; repeatable")
    p.add_argument("--logging-steps", type=int, default=1,
                   help="Trainer's logging_steps (1: every step's loss is logged and compared; each log reads "
                        "the loss and the grad norm on the host)")
    p.add_argument("--trace", metavar="DIR", help="after the measured steps, profile --trace-steps more steps "
                   "(bench/step_trace.py; rank 0 writes DIR/<row>.txt and the Chrome trace)")
    p.add_argument("--trace-steps", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--row-timeout", type=float, default=400)
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a row key: run that row (under torchrun)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


# ---------------------------------------------------------------------------------------- worker


def _ds_config(args: argparse.Namespace, extra_compile: Dict[str, Any], engine: str) -> Dict[str, Any]:
    with open(DS_CONFIG) as f:
        config = json.load(f)
    config["compile"] = {"deepcompile": True, **extra_compile}
    if engine == "deepcompile" and args.backend != "inductor":
        config["compile"]["backend"] = args.backend
    if args.precision == "fp16":
        config.pop("bf16", None)
        config["fp16"] = {"enabled": "auto"}
    for item in args.set:
        dotted, _, raw = item.partition("=")
        *sections, key = dotted.split(".")
        node = config
        for name in sections:
            node = node.setdefault(name, {})
        node[key] = json.loads(raw)
    return config


def _model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, HERE)
    from train_core import model_config  # train_bench's Llama of the same shapes (sdpa, no KV cache)

    return AutoModelForCausalLM.from_config(model_config(args))


class _Rows:
    """Random token ids as Trainer's ``input_ids``/``labels`` dicts (same rows for every engine)."""

    def __init__(self, n: int, seq: int, vocab: int):
        import torch

        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.steps + (args.trace_steps if args.trace else 0)


class _Clock:
    """Ends of optimizer steps (device synchronised) and the peak memory after the warm-up; with
    ``--trace``, a profiler window over the steps after the measured ones."""

    def __init__(self, args: argparse.Namespace, key: str):
        self.warmup, self.measured, self.ends = args.warmup, args.warmup + args.steps, []
        self.tracer = None
        if args.trace:
            sys.path.insert(0, HERE)
            from step_trace import StepTracer

            self.tracer = StepTracer(_sync, os.path.join(args.trace, f"{key}.txt"), ROWS[key][0],
                                     write=int(os.environ.get("RANK", 0)) == 0, record_memory=False)
            self.trace_steps = args.trace_steps

    def step_end(self) -> None:
        import torch

        _sync()
        self.ends.append(time.perf_counter())
        if len(self.ends) == self.warmup and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if self.tracer is not None:
            if len(self.ends) == self.measured:
                self.tracer.start()
            elif len(self.ends) == self.measured + self.trace_steps:
                self.tracer.stop(self.trace_steps)


def _trainer_run(args, key: str, engine: str, torch_compile: bool, extra: Dict[str, Any], clock: _Clock):
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    total = _total_steps(args)
    world = int(os.environ.get("WORLD_SIZE", 1))
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer_bench_"), deepspeed=_ds_config(args, extra, engine),
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.accumulation,
        max_steps=total, learning_rate=1e-4, warmup_steps=2, max_grad_norm=1.0, logging_steps=args.logging_steps,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, dataloader_drop_last=True,
        bf16=args.precision == "bf16", fp16=args.precision == "fp16", torch_compile=torch_compile,
        torch_compile_backend=args.backend if torch_compile else None, use_cpu=not torch.cuda.is_available())
    model = _model(args)  # after TrainingArguments: ZeRO-3 builds it inside deepspeed.zero.Init

    class Timing(TrainerCallback):
        def on_step_end(self, *a, **kw):
            clock.step_end()

    data = _Rows(total * args.micro_batch * args.accumulation * world, args.seq, args.vocab)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Timing()])
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "step" in e]
    return trainer.model_wrapped, losses


def _accelerate_run(args, key: str, engine: str, torch_compile: bool, extra: Dict[str, Any], clock: _Clock):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    total = _total_steps(args)
    plugin = DeepSpeedPlugin(hf_ds_config=_ds_config(args, extra, engine))
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=args.precision,
                              gradient_accumulation_steps=args.accumulation,
                              dynamo_backend=args.backend if torch_compile else "no",
                              cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    world = accelerator.num_processes
    loader = torch.utils.data.DataLoader(_Rows(total * args.micro_batch * args.accumulation * world, args.seq,
                                               args.vocab), batch_size=args.micro_batch, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses, window = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        window.append(accelerator.reduce(loss.detach(), "mean").item())
        if accelerator.sync_gradients:
            clock.step_end()
            losses.append(sum(window) / len(window))
            window = []
    return model, losses


def run_worker(args: argparse.Namespace) -> None:
    key = args.worker
    label, engine, loop, torch_compile, extra = ROWS[key]
    if engine == "deepcompile":
        import deepcompile

        deepcompile.serve_as_deepspeed()
    import torch
    import torch.distributed as dist

    clock = _Clock(args, key)
    run = _trainer_run if loop == "trainer" else _accelerate_run
    wrapped, losses = run(args, key, engine, torch_compile, extra, clock)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ends = clock.ends[: args.warmup + args.steps]  # not the traced steps after them
    measured = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])]
    step_s = statistics.median(measured) if measured else float("nan")
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    first = clock.ends[0] - PROCESS_START if clock.ends else float("nan")
    ready = clock.ends[args.warmup - 1] - PROCESS_START if len(clock.ends) >= args.warmup else float("nan")
    worst = torch.tensor([step_s, float(peak), first, ready], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    step_s, peak, first, ready = worst.tolist()
    summary = getattr(wrapped, "summary_line", None)
    if int(os.environ.get("RANK", 0)) == 0:
        tokens = args.micro_batch * args.seq * args.accumulation
        row = {"key": key, "label": label, "status": "ok", "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
               "peak_gib": peak / 2**30 if cuda else None, "first_step_s": first, "scheduled_s": ready,
               "losses": losses, "measured_steps": len(measured), "summary": summary}
        with open(args.out, "w") as f:
            json.dump(row, f)


# ---------------------------------------------------------------------------------------- driver


def _worker_argv(argv: List[str]) -> List[str]:
    """The driver's options a worker needs (not --rows/--json/--markdown/--nproc/--row-timeout)."""
    out, skip = [], {"--rows", "--json", "--markdown", "--nproc", "--row-timeout"}
    it = iter(argv)
    for a in it:
        name = a.split("=", 1)[0]
        if name in skip:
            if "=" not in a:
                next(it, None)
            continue
        out.append(a)
    return out


def run_row(args: argparse.Namespace, argv: List[str], key: str) -> Dict[str, Any]:
    sys.path.insert(0, HERE)
    from row_process import TORCHRUN_ENV, failure, run_streaming

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               os.path.abspath(__file__), *_worker_argv(argv), "--worker", key, "--out", out]
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        env.setdefault("PYTHONUNBUFFERED", "1")
        code, tail = run_streaming(cmd, args.row_timeout, env=env)
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
    status, note = failure(code, tail, args.row_timeout)
    return {"key": key, "label": ROWS[key][0], "status": status, "note": note}


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: List[Dict[str, Any]]) -> str:
    peer = next((r for r in rows if r["key"] == "ds-dc" and r["status"] == "ok"), None)
    ref = peer or next((r for r in rows if ROWS[r["key"]][1] == "deepspeed" and r["status"] == "ok"), None)
    lines = ["| row | ms/step | x DS DeepCompile | tokens/s/GPU | peak GiB | first step s | scheduled s | "
             "max loss diff vs " + (ref["key"] if ref else "-") + " | first/last loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['status']}: {r.get('note', '')} | | | | | | | |")
            continue
        speed = f"{peer['step_ms'] / r['step_ms']:.2f}x" if peer else "-"
        diff = "-"
        if ref is not None and r is not ref:
            n = min(len(ref["losses"]), len(r["losses"]))
            diff = f"{max(abs(a - b) for a, b in zip(ref['losses'][:n], r['losses'][:n])):.4f}" if n else "-"
        loss = f"{r['losses'][0]:.3f} / {r['losses'][-1]:.3f}" if r["losses"] else "-"
        lines.append(f"| {r['label']} | {r['step_ms']:.1f} | {speed} | {r['tokens_per_s']:.0f} | "
                     f"{_fmt(r['peak_gib'], '.2f')} | {r['first_step_s']:.0f} | {r['scheduled_s']:.0f} | {diff} | {loss} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    unknown = [k for k in args.rows.split(",") if k not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    sys.path.insert(0, HERE)
    from row_process import stop_children_on_termination

    stop_children_on_termination()
    rows = [run_row(args, argv, key) for key in args.rows.split(",")]
    header = (f"{args.preset} Llama, {args.precision}, micro-batch {args.micro_batch} x seq {args.seq} per rank, "
              f"accumulation {args.accumulation}, {args.nproc} ranks, {args.warmup} warm-up + {args.steps} measured "
              f"steps, compiled rows: {args.backend}, logging_steps {args.logging_steps}" + "".join(f", {item}" for item in args.set))
    text = header + "\n\n" + table(rows)
    for r in rows:
        if r.get("summary"):
            text += f"\n\n{r['key']}: {r['summary']}"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
