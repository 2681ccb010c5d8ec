"""Where the time to the first scheduled step goes: a per-phase table (issue 16, part 6).

    torchrun --nproc-per-node 1 bench/compile_time.py --methods z3-prefetch,fsdp2 [train_bench options]
        [--caches cold,warm] [--cprofile DIR] [--markdown PATH]
    python3 bench/compile_time.py ...   # one CPU process: the process group is set up for you

Each method of ``bench/train_bench.py`` is run from a fresh model until the end of its first
scheduled step (the first step that runs the final plan compiled; for FSDP2 the first step), in
a fresh Inductor cache directory. ``--caches cold,warm`` (the default) measures the cold run, then
starts the method again on the caches it left (the ``--warm-start`` of train_bench): Inductor's
codegen is then mostly cache hits, and what remains is Dynamo, aot_autograd, deepcompile's own
passes, the profiler and Inductor's cache loads.

Time is charged to phases by wrapping the functions below (exclusive time: a phase nested in
another is subtracted from it). "step: everything else" is the steps' wall time outside every
phase: eager execution, the optimizer, aot_autograd's runtime glue. The wrapped names are looked
up where their callers find them; a missing name is an error (the table would silently lose a
phase otherwise), so a torch or deepcompile refactor shows up here first.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import importlib
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import train_bench  # noqa: E402  (puts this checkout of deepcompile first on sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REST = "step: everything else"


class PhaseClock:
    """Exclusive wall time per phase, for phases entered through wrapped functions. ``now``: the
    clock read at every phase boundary (seconds; ``time.perf_counter`` unless a test injects one)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self.seconds: Dict[str, float] = collections.defaultdict(float)
        self.calls: Dict[str, int] = collections.defaultdict(int)
        self._stack: List[List[Any]] = []  # [phase, start of its current segment]
        self._undo: List[Tuple[Any, str, Any]] = []

    def push(self, phase: str) -> None:
        now = self._now()
        if self._stack:
            top = self._stack[-1]
            self.seconds[top[0]] += now - top[1]
        self._stack.append([phase, now])
        self.calls[phase] += 1

    def pop(self) -> None:
        now = self._now()
        phase, start = self._stack.pop()
        self.seconds[phase] += now - start
        if self._stack:
            self._stack[-1][1] = now

    @property
    def current(self) -> Optional[str]:
        return self._stack[-1][0] if self._stack else None

    @contextlib.contextmanager
    def phase(self, name: str):
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    def wrap(self, where: str, attr: str, phase: Any, only_under: Optional[str] = None) -> None:
        """Charge calls of ``where.attr`` (``where``: a module path, or ``module:Class``) to
        ``phase`` (a name, or a function of the call's arguments giving one). ``only_under``:
        charge only when the current phase starts with it (else the call stays in its caller's)."""
        owner = _resolve(where)
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        clock = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if only_under is not None and not (clock.current or "").startswith(only_under):
                return fn(*args, **kwargs)
            clock.push(phase(*args, **kwargs) if callable(phase) else phase)
            try:
                return fn(*args, **kwargs)
            finally:
                clock.pop()

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def unwrap(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo = []


def _resolve(where: str) -> Any:
    module, _, cls = where.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


def _profile_phase(driver, *args, **kwargs) -> str:
    return f"deepcompile: profiler run ({driver.mode})"


# (where, attribute, phase, only_under). Order does not matter: nesting decides.
PHASES: List[Tuple[str, str, Any, Optional[str]]] = [
    # torch
    ("torch._dynamo.convert_frame", "_compile", "dynamo: trace frame, guards, bytecode", None),
    ("torch._dynamo.output_graph:OutputGraph", "call_user_compiler", "dynamo: backend call (other)", None),
    ("torch._dynamo.backends.common", "aot_module_simplified", "aot_autograd: trace joint, glue", None),
    ("torch._functorch.partitioners", "min_cut_rematerialization_partition", "aot_autograd: min-cut partition", None),
    ("torch._inductor.compile_fx", "min_cut_rematerialization_partition", "aot_autograd: min-cut partition", None),
    ("torch._inductor.compile_fx", "_recursive_joint_graph_passes", "inductor: joint-graph passes", None),
    ("torch._inductor.compile_fx", "_compile_fx_inner", "inductor: cache lookup, load, wrappers", None),
    ("torch._inductor.compile_fx", "fx_codegen_and_compile", "inductor: lowering + codegen (cache miss)", None),
    # deepcompile's backend and passes
    ("deepcompile.compiler.backend:DeepCompileBackend", "_compile_forward", "deepcompile: backend (other)", None),
    ("deepcompile.compiler.backend:DeepCompileBackend", "_compile_backward", "deepcompile: backend (other)", None),
    ("deepcompile.compiler.backend:DeepCompileBackend", "__call__", "deepcompile: backend (other)", None),
    ("deepcompile.compiler.backend", "copy_param_views_in_outputs", "deepcompile: escaping views pass", None),
    # the graph passes run from compiler/pipeline.py's list (the first compile and re-plans alike)
    ("deepcompile.compiler.pipeline", "insert_gather_release", "deepcompile: ZeRO-3 gather/release pass", None),
    ("deepcompile.compiler.pipeline", "insert_reductions", "deepcompile: reduce pass", None),
    ("deepcompile.compiler.pipeline", "apply_prefetch", "deepcompile: prefetch pass", None),
    ("deepcompile.compiler.pipeline", "saved_values", "deepcompile: activation passes", None),
    ("deepcompile.compiler.backend", "_copy_graph_module", "deepcompile: graph copies", None),
    ("deepcompile.compiler.pipeline", "to_slot_ops", "deepcompile: ids-as-data lowering", None),
    ("deepcompile.compiler.backend", "rebind", "deepcompile: graph copies", None),
    ("deepcompile.compiler.replan", "_copy", "deepcompile: graph copies", None),
    ("deepcompile.scheduling.planner", "graph_signature", "deepcompile: graph signature", None),
    ("deepcompile.scheduling.planner", "plan_prefetch", "deepcompile: planner", None),
    ("deepcompile.scheduling.planner", "graph_gathers", "deepcompile: planner", None),
    ("deepcompile.scheduling.planner", "plan_persistent", "deepcompile: planner", None),
    ("deepcompile.compiler.partitioner", "make_partition_fn", "deepcompile: backend (other)", None),
    ("torch.fx.graph_module:GraphModule", "recompile", "deepcompile: GraphModule.recompile", "deepcompile"),
    # the schedule
    ("deepcompile.scheduling.driver:ScheduleDriver", "run_profiled", _profile_phase, None),
    ("deepcompile.scheduling.driver", "measure_allgather", "deepcompile: all-gather time model", None),
    ("deepcompile.compiler.replan", "replan_in_place", "deepcompile: re-plan", None),
    ("deepcompile.scheduling.report:ScheduleReport", "planned", "deepcompile: schedule report", None),
    ("deepcompile.scheduling.report:ScheduleReport", "measured", "deepcompile: schedule report", None),
]


def install(clock: PhaseClock) -> None:
    for where, attr, phase, only_under in PHASES:
        clock.wrap(where, attr, phase, only_under)


def run_to_schedule(ctx: "train_bench.Context", method: "train_bench.Method", clock: PhaseClock,
                    profiler: Optional[cProfile.Profile]) -> Tuple[List[float], bool]:
    """Build ``method`` and step it until its first scheduled step; returns the step times and
    whether that step was reached within ``--warmup`` steps."""
    runner = method.build(ctx)
    times: List[float] = []
    try:
        for tokens in ctx.batches[: ctx.args.warmup]:
            train_bench.sync(ctx)
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            with clock.phase(REST):
                runner.step(tokens)
                train_bench.sync(ctx)
            if profiler is not None:
                profiler.disable()
            times.append(time.perf_counter() - start)
            if runner.scheduled():
                return times, True
        return times, False
    finally:
        runner.close()
        del runner
        train_bench.teardown(ctx)


def inductor_cache_counts() -> Dict[str, int]:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {k: int(c.get(k, 0)) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


def measure(ctx, method, cache: str, cprofile_dir: Optional[str]) -> Dict[str, Any]:
    from torch._inductor.utils import clear_inductor_caches

    clear_inductor_caches()  # in-memory caches: only the disk cache carries over between runs
    before = inductor_cache_counts()
    clock = PhaseClock()
    install(clock)
    profiler = cProfile.Profile() if cprofile_dir else None
    try:
        times, reached = run_to_schedule(ctx, method, clock, profiler)
    finally:
        clock.unwrap()
    after = inductor_cache_counts()
    if profiler is not None and ctx.rank == 0:
        os.makedirs(cprofile_dir, exist_ok=True)
        profiler.dump_stats(os.path.join(cprofile_dir, f"{method.key}-{cache}.pstats"))
    return dict(method=method.name, cache=cache, times=times, reached=reached, seconds=dict(clock.seconds),
                calls=dict(clock.calls), cache_counts={k: after[k] - before[k] for k in after})


def table(results: List[Dict[str, Any]]) -> str:
    """Markdown: one column per (method, cache), one row per phase."""
    phases = sorted({p for r in results for p in r["seconds"]}, key=lambda p: (p == REST, p))
    head = ["phase"] + [f"{r['method']}, {r['cache']}" for r in results]
    lines = ["| " + " | ".join(head) + " |", "| --- " + "| ---: " * len(results) + "|"]
    for p in phases:
        cells = []
        for r in results:
            s = r["seconds"].get(p)
            cells.append(f"{s:.2f} ({r['calls'].get(p, 0)})" if s is not None else "")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    total = [f"**{sum(r['times']):.2f}**" + ("" if r["reached"] else " (not reached)") for r in results]
    lines.append("| **to the end of the first scheduled step** | " + " | ".join(total) + " |")
    lines.append("| steps (s) | " + " | ".join(", ".join(f"{t:.1f}" for t in r["times"]) for r in results) + " |")
    lines.append("| Inductor FX cache hit / miss | " + " | ".join(
        f"{r['cache_counts']['fxgraph_cache_hit']} / {r['cache_counts']['fxgraph_cache_miss']}" for r in results) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--caches", default="cold,warm", help="comma list of cold, warm (warm runs after cold, on its cache)")
    p.add_argument("--cprofile", metavar="DIR", help="also write a cProfile stats file per method and cache")
    p.add_argument("--markdown", metavar="PATH", help="also append the table to PATH")
    own, rest = p.parse_known_args(argv)
    caches = [c.strip() for c in own.caches.split(",") if c.strip()]
    if not caches or any(c not in ("cold", "warm") for c in caches):
        p.error("--caches: a comma list of cold, warm")
    if "RANK" not in os.environ:  # a plain one-process run
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    args = train_bench.parse_args(rest)
    device, rank, world = train_bench.setup()
    backend = args.backend or ("inductor" if device.type == "cuda" else "eager")
    ctx = train_bench.Context(args, device, backend, rank, world, train_bench.make_batches(args, rank, device),
                              train_bench.count_params(args))
    results = []
    for key in args.methods:
        method = train_bench.method_of(key, args)  # a deepcompile row may carry a layout (bench/layouts.py)
        from torch._inductor.utils import fresh_cache

        with fresh_cache():  # one cache directory per method: cold, then warm on what cold left
            for cache in caches:
                if rank == 0:
                    print(f"== {method.name}, {cache}", flush=True)
                results.append(measure(ctx, method, cache, own.cprofile))
                if rank == 0:
                    print(f"  {sum(results[-1]['times']):.1f} s", flush=True)
    if rank == 0:
        a = args
        header = (f"model: Llama hidden {a.hidden}, {a.layers} layers, seq {a.seq}, micro-batch {a.micro_batch}; "
                  f"{world} rank(s) on {device.type}; backend {backend}; torch {torch.__version__}; "
                  f"seconds (calls), exclusive")
        out = header + "\n\n" + table(results)
        print(out, flush=True)
        if own.markdown:
            with open(own.markdown, "a") as f:
                f.write(out + "\n\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
