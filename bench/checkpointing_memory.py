"""Peak memory of deepcompile training with and without activation checkpointing, side by side,
against an independent measure of the activations checkpointing should remove.

    torchrun --nproc-per-node 1 bench/checkpointing_memory.py [--stages 3,1] [--markdown PATH]
    torchrun --nproc-per-node 1 bench/checkpointing_memory.py --preset tiny      # CPU smoke run

The model, batches and engine configuration are train_bench.py's (its model options and presets
are accepted here too; default: the ~1B Llama, micro-batch 2 x seq 2048, bf16, Inductor on CUDA).
For each ZeRO stage in ``--stages`` the same model trains twice in this process: plain, and with
every decoder layer checkpointed by transformers' ``gradient_checkpointing_enable()`` (its
default, non-reentrant ``torch.utils.checkpoint``; ``--reentrant`` adds a row with
``use_reentrant=True``).

Per row (per rank; the maximum over ranks):

* peak: ``torch.cuda.max_memory_allocated`` over the measured steps (after the warm-up);
* saved by the compiled forward: bytes of the distinct storages the compiled forward hands to
  autograd for the backward, counted with ``torch.autograd.graph.saved_tensors_hooks`` in the last
  warm-up step (parameters excluded; ZeRO-3 placeholders are a few bytes each);
* step time (median of the measured steps) and the first step's time (compilation).

The independent measure: one eager forward of the plain model (no engine, no compile) on the same
batch, counting with ``saved_tensors_hooks`` the bytes each decoder layer saves for its backward
(distinct storages, parameters excluded), and the layer's input (which a checkpointed layer
still keeps, as it keeps the other tensor inputs such as the rotary cos/sin). Checkpointing
removes A = sum over layers of (saved - input) - other inputs; in the backward one
layer at a time is recomputed, R = the largest layer's saved bytes. The summary compares the
measured peak reduction with A and with A - R, and with the compiled runs' own measure: D = the
compiled forward's saved bytes, plain - checkpointed, less the layers' other inputs (a
checkpointed layer keeps them alive in its recompute closure, unseen by ``saved_tensors_hooks``,
while the plain layer saves them: D alone would count them as removed).

``--regional`` compiles each decoder layer on its own (``engine.compile(regional=True)``);
train_bench's ``--optimizer-step-in-backward`` turns on ``compile.optimizer_step_in_backward``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import run_deepcompile  # noqa: E402  (the deepcompile rows' runner, whose model builds are watched)
import train_bench as tb  # noqa: E402  (puts the repository root first on sys.path, sets up deepcompile)
from deepcompile import compat  # noqa: E402  (after train_bench: the repository's deepcompile)

GIB = 1024**3
MIB = 1024**2


# ------------------------------------------------------------------------------------- options


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, argparse.Namespace]:
    """(this script's options, train_bench's namespace for the model, batches and engine)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True,
                                epilog="Other options (model shape, --preset, --seq, --micro-batch, --backend, "
                                       "--reduce-bucket-size, --persistence-threshold, --seed, --lr) are "
                                       "train_bench.py's.")
    p.add_argument("--stages", default="3,1", help="comma list of ZeRO stages (default: 3,1)")
    p.add_argument("--reentrant", action="store_true",
                   help="also a row per stage with gradient_checkpointing_kwargs={'use_reentrant': True}")
    p.add_argument("--regional", action="store_true",
                   help="engine.compile(regional=True): each decoder layer compiled on its own (the per-layer "
                        "backward graphs compile.optimizer_step_in_backward steps after)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (>= 2: compile, then the counting step)")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--markdown", metavar="PATH", help="also append the block to PATH")
    p.add_argument("--json", metavar="PATH", help="also write the numbers (bytes, ms) as JSON to PATH")
    own, rest = p.parse_known_args(argv)
    if own.warmup < 2:
        p.error("--warmup must be >= 2: the first step compiles, the last warm-up step counts saved tensors")
    try:
        own.stages = [int(s) for s in own.stages.split(",") if s.strip()]
    except ValueError:
        p.error(f"--stages: expected a comma list of 1, 2, 3; got {own.stages!r}")
    if not own.stages or any(s not in (1, 2, 3) for s in own.stages):
        p.error(f"--stages: expected a comma list of 1, 2, 3; got {own.stages}")
    bench_args = tb.parse_args(list(rest) + ["--methods", "z3", "--warmup", str(own.warmup),
                                             "--steps", str(own.steps)])
    return own, bench_args


# ------------------------------------------------------------------------------------- measuring


class SavedBytes:
    """``saved_tensors_hooks`` that add up the distinct storages saved for backward, skipping
    ``excluded`` storages (parameters) and attributing each to the decoder layer running when it
    was first saved (``layer`` is set by the caller's module hooks; None outside layers)."""

    def __init__(self, excluded_storages=()):
        self.excluded = set(excluded_storages)
        self.seen = set()
        self.layer: Optional[int] = None
        self.by_layer: Dict[Optional[int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = compat.storage_id(t)  # not data_ptr(): a ZeRO-3 placeholder's storage refuses reads
        if key not in self.excluded and key not in self.seen:
            self.seen.add(key)
            self.by_layer[self.layer] = self.by_layer.get(self.layer, 0) + storage.nbytes()
        # Not ``t`` itself: a tensor saved by the node that produced it would then hold that node
        # through its saved variable, a cycle through C++ that no collector frees. The eager
        # forward below runs no backward, so its 25 GiB of activations (1B model, micro-batch 8)
        # stayed allocated for the rest of the process and every later row counted them.
        return t.detach()

    @contextlib.contextmanager
    def active(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self.by_layer.values())


def parameter_storages(model: torch.nn.Module) -> set:
    return {compat.storage_id(p) for p in model.parameters()}


@dataclasses.dataclass
class EagerActivations:
    saved_per_layer: List[int]  # bytes each decoder layer saves for backward
    input_per_layer: List[int]  # bytes of each decoder layer's hidden-state input (kept by a checkpointed layer)
    shared_inputs: int  # the layers' other tensor inputs (rotary cos/sin, masks), once: also kept
    outside_layers: int  # saved outside the decoder layers (embedding, final norm, head, loss)

    @property
    def removed_by_checkpointing(self) -> int:
        return sum(s - i for s, i in zip(self.saved_per_layer, self.input_per_layer)) - self.shared_inputs

    @property
    def largest_layer(self) -> int:
        return max(self.saved_per_layer)


def eager_activations(ctx: tb.Context) -> EagerActivations:
    """One eager forward of the plain model on the first batch, counting what autograd saves."""
    model = tb.build_model(ctx, torch.bfloat16)
    counter = SavedBytes(parameter_storages(model))
    layers = list(model.model.layers)
    inputs = [0] * len(layers)
    shared: Dict[int, int] = {}  # storage -> bytes of the other tensor inputs, every layer's
    handles = []
    for index, layer in enumerate(layers):
        def enter(module, args, kwargs, index=index):
            counter.layer = index
            hidden = args[0] if args else kwargs["hidden_states"]
            inputs[index] = hidden.untyped_storage().nbytes()
            others = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
            for value in others:
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        shared[compat.storage_id(t)] = t.untyped_storage().nbytes()

        def leave(module, args, output):
            counter.layer = None

        handles.append(layer.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(layer.register_forward_hook(leave))
    tokens = ctx.batches[0]
    try:
        with counter.active():
            loss = model(input_ids=tokens, labels=tokens).loss
        del loss
    finally:
        for h in handles:
            h.remove()
    result = EagerActivations([counter.by_layer.get(i, 0) for i in range(len(layers))], inputs,
                              sum(shared.values()), counter.by_layer.get(None, 0))
    del model, counter
    tb.teardown(ctx)
    return result


@contextlib.contextmanager
def building_models(checkpoint_kwargs: Optional[dict], built: List[torch.nn.Module]):
    """train_bench's deepcompile rows build their models with ``run_deepcompile.build_model``; while
    this is active every model they build is appended to ``built`` and, with ``checkpoint_kwargs``,
    has every decoder layer checkpointed by transformers' switch (those are its checkpoint kwargs)."""
    original = run_deepcompile.build_model

    def build(ctx, dtype):
        model = original(ctx, dtype)
        if checkpoint_kwargs is not None:
            with warnings.catch_warnings():  # a deprecated alias of activation_checkpointing_enable (5.2x)
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
            model.train()
        built.append(model)
        return model

    run_deepcompile.build_model = build
    try:
        yield
    finally:
        run_deepcompile.build_model = original


@dataclasses.dataclass(frozen=True)
class Variant:
    stage: int
    checkpointing: Optional[str]  # None, "non-reentrant" or "reentrant"
    regional: bool = False  # engine.compile(regional=True)

    @property
    def label(self) -> str:
        return (f"ZeRO-{self.stage}" + (", per layer" if self.regional else "")
                + (f", checkpointed ({self.checkpointing})" if self.checkpointing else ""))


class PhasePeaks:
    """Where a step's peak falls, without an allocator history (which slows the host and so moves
    the peak; with Python stacks it also breaks checkpointed per-layer runs, NOTES.md): the
    running ``max_memory_allocated`` read where the engine's backward starts (the forward is
    done), where it returns, and where the optimizer step returns. The first reading that reaches
    the run's peak names the phase that set it."""

    PHASES = ("forward", "backward", "optimizer step")

    def __init__(self, device: torch.device):
        self.device = device
        self.readings: List[Tuple[int, str, int]] = []  # (step index, phase, running max)
        self.step_index = -1

    def _read(self, phase: str) -> None:
        self.readings.append((self.step_index, phase, torch.cuda.max_memory_allocated(self.device)))

    @contextlib.contextmanager
    def watching(self, step_index: int):
        from deepcompile.engine import Engine

        self.step_index = step_index
        backward, step = Engine.backward, Engine.step

        def watched_backward(engine, *args, **kwargs):
            self._read("forward")
            out = backward(engine, *args, **kwargs)
            self._read("backward")
            return out

        def watched_step(engine, *args, **kwargs):
            out = step(engine, *args, **kwargs)
            self._read("optimizer step")
            return out

        Engine.backward, Engine.step = watched_backward, watched_step
        try:
            yield
        finally:
            Engine.backward, Engine.step = backward, step

    def where(self, first_step: int) -> Optional[str]:
        """The phase (and measured step) whose end first saw the peak of the steps from
        ``first_step`` on."""
        mine = [r for r in self.readings if r[0] >= first_step]
        if not mine:
            return None
        top = max(value for _, _, value in mine)
        index, phase, _ = next(r for r in mine if r[2] == top)
        return f"peak set in the {phase} of measured step {index - first_step + 1}"


def variant_method(variant: Variant, counting_step: int, saved: Dict[str, int]) -> tb.Method:
    """A train_bench Method whose runner counts what the compiled forward saves at step
    ``counting_step`` (a warm-up step: train_bench resets the peak after the warm-up)."""

    def build(ctx: tb.Context) -> tb.Runner:
        kwargs = {"use_reentrant": variant.checkpointing == "reentrant"} if variant.checkpointing else None
        built: List[torch.nn.Module] = []
        with building_models(kwargs, built):
            runner = tb.deepcompile_runner(ctx, stage=variant.stage, regional=variant.regional)
        calls = [0]
        phases = PhasePeaks(ctx.device) if ctx.is_cuda else None

        def step(tokens):
            index = calls[0]
            calls[0] += 1
            if index > counting_step and phases is not None:  # the measured steps (peak reset before them)
                with phases.watching(index):
                    return runner.step(tokens)
            if index != counting_step:
                return runner.step(tokens)
            # Parameters excluded: ZeRO-1/2 save the module's weights themselves; under ZeRO-3 they
            # are the placeholders, a few bytes each (gathered values are never saved).
            counter = SavedBytes(parameter_storages(built[0]))
            with counter.active():
                loss = runner.step(tokens)
            saved["bytes"] = counter.total
            return loss

        def close():
            built.clear()  # the next row must not find this model still alive
            runner.close()

        def note() -> str:
            where = phases.where(counting_step + 1) if phases is not None else None
            return "; ".join(n for n in (runner.note(), where) if n)

        return tb.Runner(step, close=close, note=note)

    return tb.Method(variant.label, build, key=f"z{variant.stage}-{variant.checkpointing or 'plain'}")


# ------------------------------------------------------------------------------------- output


@dataclasses.dataclass
class Result:
    variant: Variant
    row: tb.Row
    saved_bytes: Optional[int]


def size(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def table(results: List[Result]) -> str:
    lines = ["| run | peak (GiB) | saved by the compiled forward | step (ms) | first step (s) | loss | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        row = r.row
        if row.status != "ok":
            lines.append(f"| {r.variant.label} | {row.status} | | | | | {row.note} |")
            continue
        peak = "n/a" if row.peak_gib is None else f"{row.peak_gib:.2f}"
        lines.append(f"| {r.variant.label} | {peak} | {size(r.saved_bytes)} | {row.step_ms:.1f} | "
                     f"{row.compile_s:.1f} | {row.loss:.4f} | {row.note} |")
    return "\n".join(lines)


def summary(eager: EagerActivations, results: List[Result]) -> List[str]:
    layers = len(eager.saved_per_layer)
    lines = [
        f"- eager forward of the plain model (saved_tensors_hooks, distinct storages, parameters excluded): "
        f"{size(eager.saved_per_layer[0])} saved per decoder layer ({layers} layers, "
        f"{size(sum(eager.saved_per_layer))}), of which the layer input {size(eager.input_per_layer[0])}; "
        f"{size(eager.outside_layers)} saved outside the layers; other layer inputs (rotary cos/sin) "
        f"{size(eager.shared_inputs)}",
        f"- removed by checkpointing every layer: A = sum(saved - input) - other inputs = "
        f"{size(eager.removed_by_checkpointing)}; "
        f"one layer recomputed in the backward: R = {size(eager.largest_layer)}",
    ]
    by_variant = {(r.variant.stage, r.variant.checkpointing): r for r in results}
    for r in results:
        plain = by_variant.get((r.variant.stage, None))
        if r.variant.checkpointing is None or plain is None:
            continue
        if r.row.peak_gib is None or plain.row.peak_gib is None:
            lines.append(f"- {r.variant.label}: no peak measured (status {r.row.status}/{plain.row.status}, or no GPU)")
            continue
        reduction = (plain.row.peak_gib - r.row.peak_gib) * GIB
        a, ar = eager.removed_by_checkpointing, eager.removed_by_checkpointing - eager.largest_layer
        line = (f"- {r.variant.label}: peak lower by {size(reduction)}; >= A: {'yes' if reduction >= a else 'no'}; "
                f">= A - R: {'yes' if reduction >= ar else 'no'}")
        if r.saved_bytes is not None and plain.saved_bytes is not None:
            # The same difference as the compiled program sees it (its partitioner may already
            # recompute cheap ops without checkpointing, so it saves less than the eager model).
            d = plain.saved_bytes - r.saved_bytes
            line += f"; >= D = {size(d)} (compiled forward's saved bytes, plain - checkpointed): " \
                    f"{'yes' if reduction >= d else 'no'}"
            # D counts the layers' other inputs (rotary cos/sin) as removed, but they are not: the
            # plain layer saves them (counted), the checkpointed one keeps them in its recompute
            # closure, where saved_tensors_hooks do not see them (tests/bench/test_bench_tools.py).
            removed = d - eager.shared_inputs
            line += f"; >= D - other inputs = {size(removed)} (what checkpointing removes): " \
                    f"{'yes' if reduction >= removed else 'no'} (margin {reduction - removed:+,.0f} bytes)"
        lines.append(line)
    return lines


def as_json(eager: EagerActivations, results: List[Result]) -> dict:
    return {
        "eager": dataclasses.asdict(eager) | {"removed_by_checkpointing": eager.removed_by_checkpointing,
                                              "largest_layer": eager.largest_layer},
        "runs": [{"stage": r.variant.stage, "checkpointing": r.variant.checkpointing, "status": r.row.status,
                  "note": r.row.note, "peak_bytes": None if r.row.peak_gib is None else r.row.peak_gib * GIB,
                  "saved_bytes": r.saved_bytes, "step_ms": r.row.step_ms, "loss": r.row.loss} for r in results],
    }


def write_json(path: str, eager: EagerActivations, results: List[Result]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(as_json(eager, results), f, indent=1)


def markdown_block(env: Dict[str, str], eager: EagerActivations, results: List[Result]) -> str:
    lines = [f"## {env['date (UTC)']} UTC, {env['device']}: activation checkpointing, peak memory", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()]
    lines += ["", table(results), ""] + summary(eager, results) + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, args = parse_args(argv)
    device, rank, world = tb.setup()
    backend = args.backend or ("inductor" if device.type == "cuda" else "eager")
    ctx = tb.Context(args, device, backend, rank, world, tb.make_batches(args, rank, device), tb.count_params(args))
    env = tb.environment(ctx)
    env["command"] = "torchrun --nproc-per-node {} {}".format(world, " ".join([sys.argv[0]] + list(
        argv if argv is not None else sys.argv[1:])))

    eager = eager_activations(ctx)
    everyone: List[Optional[EagerActivations]] = [None] * world
    dist.all_gather_object(everyone, eager)
    eager = EagerActivations([max(e.saved_per_layer[i] for e in everyone) for i in range(len(eager.saved_per_layer))],
                             [max(e.input_per_layer[i] for e in everyone) for i in range(len(eager.input_per_layer))],
                             max(e.shared_inputs for e in everyone), max(e.outside_layers for e in everyone))
    if rank == 0:
        print("\n".join(summary(eager, [])), flush=True)

    modes = [None, "non-reentrant"] + (["reentrant"] if own.reentrant else [])
    results: List[Result] = []
    for stage in own.stages:
        for mode in modes:
            variant = Variant(stage, mode, regional=own.regional)
            saved: Dict[str, int] = {}
            method = variant_method(variant, counting_step=own.warmup - 1, saved=saved)
            if rank == 0:
                print(f"== {variant.label}", flush=True)
            mine = tb.measure(ctx, method)
            per_rank: List[Optional[tb.RankMeasurement]] = [None] * world
            dist.all_gather_object(per_rank, mine)
            saved_all: List[Optional[int]] = [None] * world
            dist.all_gather_object(saved_all, saved.get("bytes"))
            row = tb.combine(ctx, method, per_rank)
            counted = [s for s in saved_all if s is not None]
            results.append(Result(variant, row, max(counted) if len(counted) == world else None))
            if rank == 0:
                print("  " + table(results[-1:]).splitlines()[-1], flush=True)
                if own.json:  # after every row: a run cut short by a time limit keeps what it measured
                    write_json(own.json, eager, results)

    if rank == 0:
        block = markdown_block(env, eager, results)
        print("\n" + block, flush=True)
        if own.markdown:
            os.makedirs(os.path.dirname(os.path.abspath(own.markdown)), exist_ok=True)
            with open(own.markdown, "a", encoding="utf-8") as f:
                f.write(block + "\n")
            print(f"appended to {own.markdown}", flush=True)
        if own.json:
            write_json(own.json, eager, results)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
