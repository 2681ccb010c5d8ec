"""``deepcompile check ds_config.json --world-size N [--trainer | --accelerate] [--model config.json]``:
is this config accepted, and what do its ``"auto"`` values become?

Prints every problem at once (``ConfigError`` carries them all), then, for a valid config, each
``"auto"`` key with the value ``initialize`` would give it at that world size. Some ``"auto"``
values follow from the model (``bf16.enabled`` from its parameter dtype, the bucket sizes from
its hidden size): without ``--model`` they are listed as needing it. ``--model`` takes a
transformers ``config.json`` (or a model folder) and builds the model on the meta device (no
memory, no weights) to resolve them. Exit code 0: accepted; 1: problems; 2: unreadable input.

``--trainer`` / ``--accelerate``: the config is one HF Trainer (or accelerate's ``prepare``
without Trainer) fills before handing it over. The ``"auto"`` values they fill are listed with
where each comes from, and the rest of the config is checked with those keys as they will arrive:
the batch sizes as Trainer computes them (consistent at any world size), the other filled keys at
their TrainingArguments / accelerate defaults (``gradient_clipping`` 1.0, ...). Without the option,
a refusal that Trainer's filling would lift says to pass it. The lists of filled keys were read
from transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``_finalize`` and
accelerate's ``Accelerator._prepare_deepspeed`` (transformers 5.24, accelerate 1.15).

Every independent problem comes in one run: a key refused while parsing is dropped and the rest is
parsed again, so the checks that run after parsing (batch sizes, rules across sections, the world
size) still report on everything the refused keys do not feed.

Which keys depend on the model is not hard-coded here: the config is resolved against two small
stand-in models that differ in dtype and hidden size, and the keys whose values differ are those
the model decides (only the public ``Config.resolve`` is used).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any, Dict, List, Optional, Tuple

AUTO = "auto"


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="validate a DeepSpeed-style config and show its resolved \"auto\" values",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the JSON config file")
    p.add_argument("--world-size", type=int, default=None,
                   help="number of ranks the run will have (default 1, said in the output: batch sizes and "
                        "hybrid/hpZ groups depend on it)")
    p.add_argument("--model", help="a transformers config.json or model folder, to resolve the model's \"auto\" values")
    p.add_argument("--show-config", action="store_true", help="also print the whole resolved config as JSON")
    by = p.add_mutually_exclusive_group()
    by.add_argument("--trainer", dest="filled_by", action="store_const", const="trainer",
                    help="the config goes through HF Trainer: check it as Trainer hands it over (its \"auto\" "
                         "values filled)")
    by.add_argument("--accelerate", dest="filled_by", action="store_const", const="accelerate",
                    help="the config goes through accelerate's prepare() without Trainer (fills fewer keys)")


# "auto" keys HF Trainer / accelerate replace before deepcompile sees the config: key -> (where the
# value comes from, the value checked in its place: the TrainingArguments / accelerate default).
# The three batch keys are handled apart (_hand_over): Trainer fills them consistently. The
# hidden-size keys (reduce_bucket_size, ...) are not here: deepcompile derives the values Trainer
# and accelerate would, so they stay "auto" and are resolved as usual.
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
FILLS = {
    "trainer": {
        "train_micro_batch_size_per_gpu": ("TrainingArguments.per_device_train_batch_size", None),
        "gradient_accumulation_steps": ("TrainingArguments.gradient_accumulation_steps", None),
        "train_batch_size": ("world size * per_device_train_batch_size * gradient_accumulation_steps", None),
        "gradient_clipping": ("TrainingArguments.max_grad_norm", 1.0),
        "optimizer.params.lr": ("TrainingArguments.learning_rate", 5e-5),
        "optimizer.params.betas": ("TrainingArguments.adam_beta1, adam_beta2", [0.9, 0.999]),
        "optimizer.params.eps": ("TrainingArguments.adam_epsilon", 1e-8),
        "optimizer.params.weight_decay": ("TrainingArguments.weight_decay", 0.0),
        "scheduler.params.warmup_min_lr": ("0", 0),
        "scheduler.params.warmup_max_lr": ("TrainingArguments.learning_rate", 5e-5),
        "scheduler.params.warmup_num_steps": ("TrainingArguments.warmup_steps / warmup_ratio (at least 1)", 1),
        "scheduler.params.total_num_steps": ("the number of training steps Trainer computes", 1),
        "fp16.enabled": ("TrainingArguments.fp16 or fp16_full_eval", False),
        "bf16.enabled": ("TrainingArguments.bf16 or bf16_full_eval", False),
    },
    "accelerate": {
        "train_micro_batch_size_per_gpu": ("the prepared DataLoader's batch_size", None),
        "gradient_accumulation_steps": ("Accelerator(gradient_accumulation_steps=...) / the accelerate config", None),
        "train_batch_size": ("micro-batch size * gradient_accumulation_steps * num_processes", None),
        "gradient_clipping": ("the accelerate config's gradient_clipping, else 1.0", 1.0),
        "optimizer.params.lr": ("the prepared DummyOptim's lr", 1e-3),
        "optimizer.params.weight_decay": ("the prepared DummyOptim's weight_decay", 0.0),
        "scheduler.params.warmup_min_lr": ("0 (with a DummyScheduler)", 0),
        "scheduler.params.warmup_max_lr": ("the optimizer's lr (with a DummyScheduler)", 1e-3),
        "scheduler.params.warmup_num_steps": ("the DummyScheduler's warmup_num_steps (at least 1)", 1),
        "scheduler.params.total_num_steps": ("the DummyScheduler's total_num_steps", 1),
        "fp16.enabled": ("--mixed_precision", False),
        "bf16.enabled": ("--mixed_precision", False),
    },
}
_WHO = {"trainer": "HF Trainer", "accelerate": "accelerate"}


def _hand_over(raw: Dict[str, Any], filled_by: str) -> Tuple[Dict[str, Any], List[Tuple[str, str]]]:
    """``raw`` as ``filled_by`` hands it over, and the ``(key, source)`` of each value it fills.

    The batch keys: the "auto" ones are dropped, so deepcompile derives them from those given (the
    given ones must then agree at the world size, as Trainer's own check demands); all three
    "auto" leave nothing to check. The other filled keys get the default in ``FILLS``.
    """
    out = copy.deepcopy(raw)
    filled = []
    for key in _auto_keys(raw):
        if key not in FILLS[filled_by]:
            continue
        source, value = FILLS[filled_by][key]
        filled.append((key, source))
        if key in _BATCH:
            del out[key]
        else:
            _set(out, key, value)
    return out, filled


def _set(d: Dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        d = d[part]
    d[last] = value


def _aliases() -> Dict[str, Dict[str, str]]:
    """Section path -> its alias spellings (alias -> key): problems name the key, the file may
    spell it the other way (``bfloat16``, ``prefetch_bucket_size``)."""
    from deepcompile.config import root, zero

    return {"": root.Config._aliases, "zero_optimization": zero.ZeroConfig._aliases}


def _delete(d: Dict[str, Any], dotted: str) -> bool:
    """Remove ``dotted`` (under any of its spellings) from ``d``; False when it is not there."""
    aliases = _aliases()
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(d, dict):
            return False
        spelled = aliases.get(".".join(parts[:i]), {})
        names = [k for k in d if k == part or spelled.get(k) == part]
        if not names:
            return False
        if i == len(parts) - 1:
            for k in names:
                del d[k]
            return True
        d = d[names[0]]
    return False


def _drop(d: Dict[str, Any], dotted: str) -> bool:
    """Remove ``dotted``, else its nearest enclosing key that is there; False when none is."""
    parts = dotted.split(".")
    return any(_delete(d, ".".join(parts[:n])) for n in range(len(parts), 0, -1))


def _parse_all(raw: Dict[str, Any]):
    """``(config or None, problems)``: every problem found while parsing, not only the first layer.

    ``Config.from_dict`` reports all the problems of one pass, but a section that fails hides the
    checks across sections, and a refused config never reaches the checks after parsing. So each
    refused key is dropped (its default takes its place) and the rest parsed again, until it
    parses or nothing more can be dropped. A problem reported again under an already refused key
    is a consequence of dropping it (a required key now missing): the nearest enclosing object is
    dropped instead (scheduler.params.total_num_steps: the scheduler section), so the rest is still
    checked, and from then on problems are no longer collected (a dropped section's own required
    keys would read as new problems).
    """
    from deepcompile.config import Config, ConfigError

    raw = copy.deepcopy(raw)
    problems: List[Tuple[str, str]] = []
    collecting = True
    for _ in range(8):  # each pass drops at least one key; a config is not deeper than this
        try:
            return Config.from_any(raw), problems
        except ConfigError as e:
            seen = {k for k, _ in problems}
            if collecting:
                problems += [p for p in e.problems if p[0] not in seen]
            again = {k for k, _ in e.problems if k in seen}
            # Lists, not generators: every key is dropped, not only the first that can be.
            dropped = [_delete(raw, k) for k, _ in e.problems if k not in seen]
            dropped += [_drop(raw, k) for k in again]
            collecting = collecting and not again
            if not any(dropped):
                break
    return None, problems


def _auto_keys(d: Any, prefix: str = "") -> List[str]:
    """Dotted keys whose value is "auto" in the config as written."""
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, str) and v == AUTO:
                out.append(key)
            else:
                out += _auto_keys(v, key + ".")
    return out


def _lookup(d: Dict[str, Any], dotted: str) -> Tuple[bool, Any]:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return False, None
        d = d[part]
    return True, d


def _stand_in(dtype, hidden: int):
    """A one-parameter module of ``dtype`` with a transformers-like ``config.hidden_size``."""
    import torch
    import torch.nn as nn

    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(1, dtype=dtype))
    model.config = argparse.Namespace(hidden_size=hidden)
    return model


def _model_from(path: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is not None and not isinstance(dtype, str):
        model.to(dtype)
    elif isinstance(dtype, str) and hasattr(torch, dtype):
        model.to(getattr(torch, dtype))
    return model


def _resolve(config, world_size: int, model) -> Tuple[Optional[Any], List[Tuple[str, str]]]:
    from deepcompile.config import ConfigError

    try:
        return config.resolve(world_size, model), []
    except ConfigError as e:
        return None, list(e.problems)


def _distinct(problems: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """One entry per message: a problem of several keys (three "auto" batch sizes) is reported
    under each key, and printed once."""
    out: Dict[str, str] = {}
    for key, message in problems:
        out[message] = f"{out[message]}, {key}" if message in out and key not in out[message].split(", ") \
            else out.get(message, key)
    return [(keys, message) for message, keys in out.items()]


def _print_problems(problems: List[Tuple[str, str]], heading: str) -> None:
    print(heading)
    for key, message in problems:
        first = key.split(", ")[0]  # _distinct joins the keys of one message
        print(f"  - {key}: {message}" if key and not message.startswith(first) else f"  - {message}")


def _fillable(raw: Dict[str, Any], problems: List[Tuple[str, str]]) -> List[str]:
    """The refused keys that are "auto" in ``raw`` and that HF Trainer fills."""
    autos = set(_auto_keys(raw))
    return [k for k, _ in problems if k in autos and k in FILLS["trainer"]]


def run(args) -> int:
    import torch

    try:
        with open(args.config, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        print(f"cannot read {args.config}: {e}")
        return 2
    if not isinstance(raw, dict):
        print(f"{args.config} must hold a JSON object, got {type(raw).__name__}")
        return 1
    if args.world_size is None:
        # Not silently: a config valid at one rank may be invalid at the run's world size.
        args.world_size = 1
        print("no --world-size given: checking at world size 1 (pass --world-size N for the run's number of ranks)")
    if args.world_size < 1:
        print("--world-size must be at least 1")
        return 2
    written = raw
    filled: List[Tuple[str, str]] = []
    if args.filled_by:
        raw, filled = _hand_over(raw, args.filled_by)
    try:
        config, parse_problems = _parse_all(raw)
    except (TypeError, ValueError) as e:
        print(f"{args.config}: {e}")
        return 1
    if config is None:  # nothing left that parses: the problems found so far are all there is
        return _refuse(args, parse_problems, written)

    autos = _auto_keys(raw)
    model_decides: List[str] = []  # "auto" keys whose value the model decides
    with_some_models: List[Tuple[str, str]] = []  # problems that depend on the model
    values_for = ""  # set when only one stand-in model is accepted: the values are that model's
    if args.model:
        try:
            model = _model_from(args.model)
        except Exception as e:  # noqa: BLE001  (transformers raises many kinds)
            print(f"cannot build the model of {args.model}: {type(e).__name__}: {e}")
            return 2
        resolved, problems = _resolve(config, args.world_size, model)
    else:
        resolved, problems = _resolve(config, args.world_size, _stand_in(torch.float32, 64))
        other, other_problems = _resolve(config, args.world_size, _stand_in(torch.bfloat16, 128))
        # A problem with one stand-in only comes from the model (its dtype, its size): not the
        # config's alone. Those are listed, but do not fail the check.
        keys, other_keys = {k for k, _ in problems}, {k for k, _ in other_problems}
        with_some_models = [p for p in problems if p[0] not in other_keys] + \
                           [p for p in other_problems if p[0] not in keys]
        problems = [p for p in problems if p[0] in other_keys]
        if resolved is not None and other is not None:
            a, b = resolved.to_dict(), other.to_dict()
            model_decides = [k for k in autos if _lookup(a, k) != _lookup(b, k)]
        elif resolved is None and other is not None:
            resolved, values_for = other, "a bf16 model of hidden size 128"
        elif resolved is not None and other is None:
            values_for = "an fp32 model of hidden size 64"
    refused = {k for k, _ in parse_problems}
    problems = parse_problems + [p for p in problems if p[0] not in refused]
    if problems:
        return _refuse(args, problems, written)

    print(f"{args.config}: OK at world size {args.world_size}"
          + (f" as {_WHO[args.filled_by]} hands it over" if args.filled_by else "")
          + (f" for the model of {args.model}" if args.model else ""))
    d = resolved.to_dict()
    filled_keys = {k for k, _ in filled}
    for key in _BATCH:
        # A batch size Trainer fills is its own (from TrainingArguments), not one deepcompile derives.
        print(f"  {key}: " + (f"filled by {_WHO[args.filled_by]}" if key in filled_keys else f"{d.get(key)}"))
    print(f"  zero_optimization.stage: {resolved.zero_optimization.stage}")
    if filled:
        print(f"filled by {_WHO[args.filled_by]} before deepcompile sees the config (checked as it will arrive):")
        for key, source in filled:
            print(f"  {key}: {source}")
    if autos:
        print(("\"auto\" values deepcompile fills" if args.filled_by else "\"auto\" values")
              + (f" (for {values_for}; other models are refused, see below)" if values_for else "") + ":")
        for key in autos:
            if key in model_decides:
                print(f"  {key}: depends on the model (pass --model path/to/config.json to resolve it)")
                continue
            found, value = _lookup(d, key)
            print(f"  {key}: {json.dumps(value) if found else '(set under another name: see the resolved config)'}")
    elif not filled:
        print("no \"auto\" values")
    if with_some_models:
        _print_problems(with_some_models, "refused for some models (which, --model tells):")
    if args.show_config:
        if model_decides:
            print("resolved config (the values that depend on the model are a stand-in's: pass --model):")
        print(json.dumps(d, indent=2, default=str))
    return 0


def _refuse(args, problems: List[Tuple[str, str]], raw: Dict[str, Any]) -> int:
    fillable = [] if args.filled_by else _fillable(raw, problems)
    problems = _distinct(problems)
    where = f" at world size {args.world_size}" + (f" as {_WHO[args.filled_by]} hands it over" if args.filled_by else "")
    _print_problems(problems, f"{args.config}: {len(problems)} problem(s){where}")
    if fillable:
        print(f"HF Trainer fills {', '.join(fillable)} before deepcompile sees the config: if it goes through "
              f"Trainer, run `deepcompile check {args.config} --world-size {args.world_size} --trainer` "
              "(or --accelerate for accelerate without Trainer)")
    return 1
