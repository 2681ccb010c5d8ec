"""``deepcompile check ds_config.json --world-size N [--model config.json]``: is this config
accepted, and what do its ``"auto"`` values become?

Prints every problem at once (``ConfigError`` carries them all), then, for a valid config, each
``"auto"`` key with the value ``initialize`` would give it at that world size. Some ``"auto"``
values follow from the model (``bf16.enabled`` from its parameter dtype, the bucket sizes from
its hidden size): without ``--model`` they are listed as needing it. ``--model`` takes a
transformers ``config.json`` (or a model folder) and builds the model on the meta device (no
memory, no weights) to resolve them. Exit code 0: accepted; 1: problems; 2: unreadable input.

Which keys depend on the model is not hard-coded here: the config is resolved against two small
stand-in models that differ in dtype and hidden size, and the keys whose values differ are those
the model decides (only the public ``Config.resolve`` is used).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Tuple

AUTO = "auto"


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="validate a DeepSpeed-style config and show its resolved \"auto\" values",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the JSON config file")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks the run will have (default 1)")
    p.add_argument("--model", help="a transformers config.json or model folder, to resolve the model's \"auto\" values")
    p.add_argument("--show-config", action="store_true", help="also print the whole resolved config as JSON")


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


def _print_problems(problems: List[Tuple[str, str]], heading: str) -> None:
    print(heading)
    for key, message in problems:
        print(f"  - {key}: {message}" if key and not message.startswith(key) else f"  - {message}")


def run(args) -> int:
    import torch

    from deepcompile.config import Config, ConfigError

    try:
        with open(args.config, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        print(f"cannot read {args.config}: {e}")
        return 2
    try:
        config = Config.from_any(raw)
    except ConfigError as e:
        _print_problems(e.problems, f"{args.config}: {len(e.problems)} problem(s)")
        return 1
    except (TypeError, ValueError) as e:
        print(f"{args.config}: {e}")
        return 1
    if args.world_size < 1:
        print("--world-size must be at least 1")
        return 2

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
    if problems:
        _print_problems(problems, f"{args.config}: {len(problems)} problem(s) at world size {args.world_size}")
        return 1

    print(f"{args.config}: OK at world size {args.world_size}" + (f" for the model of {args.model}" if args.model else ""))
    d = resolved.to_dict()
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        print(f"  {key}: {d.get(key)}")
    print(f"  zero_optimization.stage: {resolved.zero_optimization.stage}")
    if autos:
        print("\"auto\" values" + (f" (for {values_for}; other models are refused, see below)" if values_for else "")
              + ":")
        for key in autos:
            if key in model_decides:
                print(f"  {key}: depends on the model (pass --model path/to/config.json to resolve it)")
                continue
            found, value = _lookup(d, key)
            print(f"  {key}: {json.dumps(value) if found else '(set under another name: see the resolved config)'}")
    else:
        print("no \"auto\" values")
    if with_some_models:
        _print_problems(with_some_models, "refused for some models (which, --model tells):")
    if args.show_config:
        if model_decides:
            print("resolved config (the values that depend on the model are a stand-in's: pass --model):")
        print(json.dumps(d, indent=2, default=str))
    return 0
