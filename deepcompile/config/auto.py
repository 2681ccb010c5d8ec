"""``"auto"`` resolution and the checks that depend on the model: the only part of the config
that looks at the model (its hidden size, parameter dtypes and parameter count).

Hugging Face Trainer and accelerate write ``"auto"`` where they fill a value in before handing the
config to DeepSpeed. deepcompile fills what the model and the world size determine, at
``initialize``, and refuses the rest with an error naming the key (docs/config.md, "auto"):

* the three batch sizes: one may be ``"auto"`` (``batch.py``);
* ``bf16.enabled`` / ``fp16.enabled``: true when the model's floating-point parameters are in that
  dtype;
* ``reduce_bucket_size``: the elements of the model's largest repeated block (a decoder layer:
  the classes HF models name in ``_no_split_modules``), at least ``hidden_size ** 2`` and at most
  the key's default. HF Trainer derives ``hidden_size ** 2``, which suits DeepSpeed's eager reduce
  path; deepcompile's compiled backward pays a collective launch and a stream hand-off per bucket,
  and one layer's gradients per bucket lets each reduce overlap the next layer's backward (on
  2 H200, 1B Llama through Trainer: 99 ms/step at h**2 = 4.2M elements, 85 ms at one layer,
  bench/RESULTS.md). The served ``deepspeed.initialize`` hands a Trainer-filled h**2 back here.
* ``stage3_prefetch_bucket_size`` (the largest fused prefetch gather): the same block's elements,
  at least ``int(0.9 * hidden_size ** 2)`` (HF Trainer's value) and at most the key's default.
  Trainer's 0.9 h**2 is a look-ahead volume for DeepSpeed's eager hooks, which gather a module's
  parameters in one call whatever it is; as deepcompile's fusion cap it is below every weight of a
  decoder layer, so every prefetch group held one parameter (293 groups on the 1B bench model,
  each a host round trip and a collective launch, in a Trainer step that is host-bound: 103.4
  ms/step, then 86.5 in the next call with the layer-sized cap, bench/results/2026-11-28.md,
  "Evening"). The served ``deepspeed.initialize`` hands a Trainer-filled 0.9 h**2 back here.
* ``stage3_param_persistence_threshold``: ``10 * hidden_size`` (the value HF Trainer derives).
  A model without a hidden size gets the keys' defaults, and so does a stage-3 key under ZeRO-1/2,
  where it has no effect.

The model is duck-typed (``parameters()``, ``config.hidden_size``): this module imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from deepcompile.config import rules
from deepcompile.config.batch import complete_batch_sizes
from deepcompile.config.errors import ConfigError, is_auto

_DERIVED_BUCKETS = {"reduce_bucket_size": lambda h: h * h,
                    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                    "stage3_param_persistence_threshold": lambda h: 10 * h}
# The sizes resolved to one repeated block's elements when the model names its blocks.
_ONE_BLOCK = ("reduce_bucket_size", "stage3_prefetch_bucket_size")


def resolve(config, world_size: int, model: Any = None):
    """``config`` with every ``"auto"`` it can derive filled in, checked against the model.

    Raises :class:`ConfigError` naming every key that cannot be honoured. Idempotent.
    """
    problems: List[Tuple[str, str]] = []
    changes: Dict[str, Any] = {}
    try:
        # Batch sizes count data-parallel replicas: the ranks of one sequence-parallel group share
        # their sequences (a size that does not divide the world is refused below).
        sp = config.sequence_parallel_size
        changes.update(complete_batch_sizes(config, world_size // sp if world_size % sp == 0 else world_size))
    except ConfigError as e:
        problems.extend(e.problems)

    dtypes = _float_param_dtypes(model)
    for name, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        section = getattr(config, name)
        if not is_auto(section.enabled):
            continue
        if dtypes is None:
            problems.append((f"{name}.enabled", f"{name}.enabled is \"auto\": it follows the model's parameter "
                                                "dtype, but no model was given"))
            continue
        try:
            changes[name] = dataclasses.replace(section, enabled=dtype in dtypes)
        except ConfigError as e:
            problems.extend((k, m + f" (\"auto\": the model's parameters are torch.{dtype})") for k, m in e.problems)

    z = config.zero_optimization
    zero_changes = _derived_buckets(z, hidden_size_of(model), largest_block_numel(model))
    if zero_changes:
        changes["zero_optimization"] = z = dataclasses.replace(z, **zero_changes)

    resolved = dataclasses.replace(config, **changes) if changes else config
    facts = rules.Facts(gradient_accumulation_steps=changes.get("gradient_accumulation_steps") or 1,
                        trained_dtypes=_trainable_dtypes(model), world_size=world_size)
    problems.extend(rules.refusals(resolved, "resolve", facts))
    if problems:
        raise ConfigError(problems)
    return resolved


def _derived_buckets(z, hidden: Optional[int], block: Optional[int] = None) -> Dict[str, int]:
    defaults = {f.name: f.default for f in dataclasses.fields(z)}
    out = {}
    for name, rule in _DERIVED_BUCKETS.items():
        if is_auto(getattr(z, name)):
            useful = z.stage == 3 or name == "reduce_bucket_size"
            out[name] = rule(hidden) if hidden is not None and useful else defaults[name]
    if block is not None:
        # One repeated block's gradients per reduce bucket and parameters per fused gather (module
        # docstring), never above the key's default.
        for name in _ONE_BLOCK:
            if is_auto(getattr(z, name)) and (z.stage == 3 or name == "reduce_bucket_size"):
                out[name] = min(max(out[name] if hidden is not None else 0, block), defaults[name])
    return out


def largest_block_numel(model: Any) -> Optional[int]:
    """Elements of the largest instance of the classes ``model._no_split_modules`` names (HF
    models: the decoder layer), or None when it names none that the model has."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if model is None or not names:
        return None
    sizes = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    return max(sizes) if sizes else None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _float_param_dtypes(model: Any) -> Optional[FrozenSet[str]]:
    if model is None:
        return None
    return frozenset(_dtype_name(p.dtype) for p in model.parameters() if p.is_floating_point())


def _trainable_dtypes(model: Any) -> FrozenSet[str]:
    if model is None:
        return frozenset()
    return frozenset(_dtype_name(p.dtype) for p in model.parameters() if p.requires_grad and p.is_floating_point())


def hidden_size_of(model: Any) -> Optional[int]:
    """``model.config.hidden_size``, or the largest of ``hidden_sizes`` (HF models), else None."""
    cfg = getattr(model, "config", None)
    size = getattr(cfg, "hidden_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return max(sizes)
    return None
