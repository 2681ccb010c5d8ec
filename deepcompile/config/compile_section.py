"""The ``compile`` section: DeepSpeed's DeepCompile keys and deepcompile's own scheduling keys
(``warmup_steps``, ``prefetch``, ``selective_gather``, ``schedule``, the memory budget), which
replace DeepSpeed's hard-coded schedule (design doc, compiler-passes.md §2.2)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from deepcompile.config.errors import show
from deepcompile.config.schema import Section, fixed_key, key, off_only_key
from deepcompile.config.validators import (boolean, boolean_or, check_keys, choice, integer, number, optional,
                                           string)

# The optional ZeRO-3 passes a schedule can name (deepcompile/scheduling/schedule.py runs them).
PASS_NAMES = ("prefetch", "selective_gather")


def _schedule(value: Any, dotted: str):
    """A list of {"step": int >= 0, "passes": [names]}; normalized to a tuple of dicts."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{dotted} must be a list of {{\"step\": ..., \"passes\": [...]}} objects or null, got "
                         f"{show(value)}")
    entries, steps = [], set()
    for i, entry in enumerate(value):
        where = f"{dotted}[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be an object with keys step and passes, got {show(entry)}")
        check_keys(entry, ("step", "passes"), where)
        if "step" not in entry or "passes" not in entry:
            raise ValueError(f"{where} needs both 'step' and 'passes'")
        step = integer(0)(entry["step"], f"{where}.step")
        if step in steps:
            raise ValueError(f"{where}.step: step {step} appears twice")
        steps.add(step)
        passes = entry["passes"]
        if not isinstance(passes, (list, tuple)) or not all(isinstance(p, str) for p in passes):
            raise ValueError(f"{where}.passes must be a list of pass names, got {show(passes)}")
        unknown = [p for p in passes if p not in PASS_NAMES]
        if unknown:
            raise ValueError(f"{where}.passes: unknown pass {unknown[0]!r}; accepted: {', '.join(PASS_NAMES)}")
        entries.append({"step": step, "passes": tuple(dict.fromkeys(passes))})
    return tuple(entries)


@dataclasses.dataclass(frozen=True)
class CompileConfig(Section):
    _path = "compile"
    deepcompile: bool = fixed_key("compile.deepcompile")
    # deepcompile's own: whether the engine compiles itself, and with which inner compiler
    auto_compile: Optional[bool] = key(
        optional(boolean), None, "Compile the engine at initialize, through deepcompile's passes with compile.backend. "
        "null (default): yes for deepspeed.initialize as served by deepcompile.serve_as_deepspeed() (HF Trainer, "
        "accelerate: whether or not the script sets torch_compile; their torch.compile settings only choose the "
        "backend and per-layer graphs), no for deepcompile.initialize (compiled by engine.compile()). false: the "
        "engine runs uncompiled (eager ZeRO hooks) until engine.compile() is called.")
    backend: str = key(choice("inductor", "eager"), "inductor",
                       "The compiler deepcompile's passes hand each graph to when the engine compiles itself "
                       "(compile.auto_compile): Inductor, or 'eager' (the FX graph runs as traced, no code "
                       "generation: fast to compile, e.g. on CPU).")
    free_activation: bool = key(boolean, False, "Free saved activations in the backward right after their last use "
                                "(compiled graphs, every backend and stage).")
    free_activation_threshold: int = key(integer(0), 10 * 1024 * 1024,
                                         "Bytes; free_activation frees tensors larger than this.")
    tiled_loss: Any = key(
        boolean_or("planned"), False, "Compute a causal LM's loss (cross-entropy over its LM head's output) a chunk of "
        "tokens at a "
        "time, in the forward and again in the backward, so the [tokens, vocab] logits, their fp32 upcast and their "
        "gradient are never held whole (passes/tiled_loss.py). The model's returned logits are then an expanded NaN "
        "of their shape (no memory). 'planned': only where the logits' bytes exceed 2% of the memory budget "
        "(passes/tiling_choice.py). Needs a compiled engine; with true, a forward that computed no such loss raises.")
    tiled_loss_chunk_tokens: int = key(integer(0), 0, "Tokens per chunk of compile.tiled_loss; 0: as many as fit "
                                       "256 MiB of fp32 logits (about 2100 tokens at a 32k vocabulary, 520 at 128k).")
    tiled_mlp: Any = key(
        boolean_or("planned"), False, "Compute each gated MLP (Llama's, Qwen2's, Mistral's, Gemma's "
        "down(act(gate(x)) * up(x))) a "
        "chunk of tokens at a time and recompute it in the backward, so its [tokens, intermediate] activations are "
        "never saved (passes/tiled_mlp.py; ALST's tiled MLP): for long sequences. Costs the gate and up matmuls once "
        "more in the backward. 'planned': only MLPs whose intermediates' bytes exceed 2% of the memory budget "
        "(passes/tiling_choice.py). Needs a compiled engine; with true, a forward that computed no gated MLP raises.")
    tiled_mlp_chunk_tokens: int = key(integer(0), 0, "Tokens per chunk of compile.tiled_mlp; 0: as many as keep one "
                                      "intermediate tensor within 256 MiB at 4 bytes an element (4681 tokens at an "
                                      "intermediate size of 14336).")
    packed_sequences: bool = key(
        boolean, False, "Packed rows (position_ids restarting inside a row, transformers' rule): attention stays "
        "inside each document through one op that also serves unpacked batches (sequence_parallel/"
        "packed_attention.py: on CUDA flash attention's variable-length kernel, bf16/fp16 only; on CPU a "
        "block-causal mask), instead of an S x S mask. With sequence_parallel_size > 1 packed rows are refused "
        "without it; with 1 it replaces the mask transformers traces from position_ids in whole-model graphs "
        "(passes/causal_mask.py). Refused for models whose attention is not plain causal.")
    offload_activation: bool = key(boolean, False, "Copy saved activations to host memory in the forward and reload "
                                   "them ahead of their use in the backward, as far as the memory budget requires "
                                   "(compiled graphs).")
    offload_activation_pin_memory: bool = key(boolean, True, "Pinned host buffers for offload_activation (CUDA).")
    offload_opt_states: bool = key(boolean, False, "Keep the optimizer state (and ZeRO-1/2 fp32 master partitions) "
                                   "in pinned host memory as far as the memory budget requires; reloaded for the "
                                   "step.")
    offload_parameters: bool = key(boolean, False, "ZeRO-3 only: the parameter shards (the fp32 masters) may live in "
                                   "pinned host memory between steps, as far as the memory budget requires after the "
                                   "optimizer state; gathers read them from there. Stages 1 and 2: refused.")
    symmetric_memory: bool = off_only_key("compile.symmetric_memory")
    double_buffer: bool = key(boolean, True, "Double-buffered gradient reduce buckets (with "
                              "zero_optimization.overlap_comm false there is one bucket).")
    debug_log: bool = key(boolean, False, "Rank-0 graph and timing logs.")
    debug_checks: bool = key(boolean, False, "Verify while training that no parameter placeholder reaches a "
                             "computation and that every gradient is reduced exactly as often as it is "
                             "produced (deepcompile/debug_checks.py); raises DebugCheckError otherwise.")
    optimizer_step_in_backward: bool = key(
        boolean, False, "ZeRO-3: step each parameter during the backward of a window's last micro-step, as soon as "
        "its gradient is final, and free its gradient partition then (deepcompile/zero/backward_step.py); with "
        "engine.compile(regional=True) a backward holds about one layer's gradients at a time. Needs no "
        "gradient_clipping and no optimizer-state or parameter offload.")
    report_dir: Optional[str] = key(optional(string), None, "Directory for graph/profile reports, or null.")
    sync_before_reduce: bool = key(boolean, False, "Debug: device sync before each reduce.")
    sync_after_reduce: bool = key(boolean, False, "Debug: device sync after each reduce.")
    sync_before_allgather: bool = key(boolean, False, "Debug: device sync before each all-gather.")
    sync_after_allgather: bool = key(boolean, False, "Debug: device sync after each all-gather.")
    keep_int_input_tensors: bool = fixed_key("compile.keep_int_input_tensors")
    keep_all_input_tensors: bool = fixed_key("compile.keep_all_input_tensors")
    # deepcompile's own scheduling keys (not in DeepSpeed)
    warmup_steps: int = key(integer(0), 5, "ZeRO-3: optimizer step from which prefetch and selective_gather apply "
                            "(profiled in the step before).")
    prefetch: bool = key(boolean, True, "ZeRO-3: after warm-up, launch fused all-gathers ahead of their use, "
                         "planned from a profile within the memory budget (off with "
                         "zero_optimization.stage3_max_live_parameters 0).")
    selective_gather: bool = key(boolean, True, "ZeRO-3: after warm-up, keep the parameters whose re-gathering "
                                 "costs most gathered, within the memory budget (off with "
                                 "zero_optimization.stage3_max_reuse_distance 0).")
    schedule: Optional[tuple] = key(_schedule, None, "ZeRO-3: explicit pass schedule replacing the one built from "
                                    "warmup_steps/prefetch/selective_gather: a list of {\"step\": int, "
                                    "\"passes\": [\"prefetch\" | \"selective_gather\", ...]}.")
    verify_plan: bool = key(boolean, False, "ZeRO-3: run the first micro-step under a new plan through the "
                            "profiler once more (interpreted, un-fused), to measure each graph's peak for the "
                            "schedule report. Off: the report says 'not measured' and the planned graphs run "
                            "compiled from that step on.")
    memory_budget_fraction: float = key(number(0.0, 1.0, low_open=True), 0.9,
                                        "Fraction of device memory the profile-guided passes may plan for.")
    memory_budget_bytes: Optional[int] = key(optional(integer(1)), None,
                                             "Bytes the profile-guided passes may plan for; overrides "
                                             "memory_budget_fraction when set.")
