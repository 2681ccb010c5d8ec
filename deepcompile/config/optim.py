"""The ``optimizer`` and ``scheduler`` sections: what deepcompile builds when ``initialize`` gets
no optimizer or schedule object (deepcompile/optim_builder.py builds them)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from deepcompile.config import inert
from deepcompile.config.errors import AUTO, is_auto, show
from deepcompile.config.schema import Section, fixed_key, key
from deepcompile.config.validators import Check, boolean, choice, integer, number, only, optional

HF_FILLS = "HF Trainer replaces it with TrainingArguments.{} before handing the config over"


def _betas(value: Any, dotted: str) -> Tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{dotted} must be a list of two numbers in [0, 1), got {show(value)}")
    return tuple(number(0.0, 1.0)(b, f"{dotted}[{i}]") for i, b in enumerate(value))  # type: ignore[return-value]


def _lrs(value: Any, dotted: str):
    """A learning rate, or a list of them (one per optimizer param group), as DeepSpeed's schedulers take."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{dotted} must be a number or a non-empty list of numbers")
        return tuple(number(0.0)(v, f"{dotted}[{i}]") for i, v in enumerate(value))
    return number(0.0)(value, dotted)


def _finite(value: Any, dotted: str) -> float:
    """Any finite number (DeepSpeed takes any float where the learning rate it gives cannot turn
    negative)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{dotted} must be a finite number, got {show(value)}")
    return float(value)


class Param:
    """One key of optimizer.params / scheduler.params: validator, default, "auto" handling."""

    REQUIRED = object()

    def __init__(self, check: Check, default: Any, doc: str, auto: Any = None, no_auto: Optional[str] = None):
        self.check, self.default, self.doc, self.auto, self.no_auto = check, default, doc, auto, no_auto


def _fixed_param(dotted: str) -> Param:
    value, why = inert.FIXED_VALUE[dotted]
    return Param(only(value, why), value, f"Only {json.dumps(value)}: {why}.")


_ADAM_PARAMS = {
    "lr": Param(number(0.0), 1e-3, "Learning rate.", no_auto=HF_FILLS.format("learning_rate")),
    "betas": Param(_betas, (0.9, 0.999), "Moment decay rates.", no_auto=HF_FILLS.format("adam_beta1/adam_beta2")),
    "eps": Param(number(0.0), 1e-8, "Denominator term.", no_auto=HF_FILLS.format("adam_epsilon")),
    "weight_decay": Param(number(0.0), 0.0, "Weight decay (DeepSpeed's default 0, not torch's 0.01).",
                          no_auto=HF_FILLS.format("weight_decay")),
    "adam_w_mode": Param(boolean, True, "Adam only: true (DeepSpeed's default) = decoupled weight decay, i.e. "
                                        "torch.optim.AdamW; false = L2 penalty added to the gradient, "
                                        "torch.optim.Adam."),
    "bias_correction": _fixed_param("optimizer.params.bias_correction"),
    "amsgrad": Param(boolean, False, "AMSGrad variant (torch's implementation)."),
    "torch_adam": Param(boolean, False, "Any value: " + inert.NO_EFFECT["optimizer.params.torch_adam"] + "."),
}
_SGD_PARAMS = {
    "lr": Param(number(0.0), 1e-3, "Learning rate.", no_auto=HF_FILLS.format("learning_rate")),
    "momentum": Param(number(0.0), 0.0, "Momentum factor."),
    "dampening": Param(number(0.0), 0.0, "Momentum dampening."),
    "weight_decay": Param(number(0.0), 0.0, "L2 penalty.", no_auto=HF_FILLS.format("weight_decay")),
    "nesterov": Param(boolean, False, "Nesterov momentum."),
}
# Canonical type name -> accepted params. DeepSpeed matches its optimizer names case-insensitively.
OPTIMIZER_TYPES: Dict[str, Dict[str, Param]] = {"Adam": _ADAM_PARAMS, "AdamW": _ADAM_PARAMS, "SGD": _SGD_PARAMS}

_STEPS_NO_AUTO = "it is the training length, which HF Trainer computes from the data and epochs before handing " \
                 "the config over"
_WARMUP_NO_AUTO = "HF Trainer fills it from TrainingArguments.warmup_steps / warmup_ratio"
_WARMUP_COMMON = {
    # 0: what HF Trainer and accelerate (a DummyScheduler) hand over without warm-up, up to the
    # releases that fill at least 1 for DeepSpeed 0.19.3+, which refuses 0 (transformers 5.25,
    # accelerate 1.16 do); earlier DeepSpeed read it as 2 (docs/migrating-from-deepspeed.md).
    "warmup_num_steps": Param(integer(0), 1000, "Warm-up length in optimizer steps; values below 2 (0 included) "
                                                "act as 2, as in DeepSpeed.", no_auto=_WARMUP_NO_AUTO),
    "warmup_type": Param(choice("log", "linear"), "log", "Shape of the warm-up: \"log\" or \"linear\"."),
    "last_batch_iteration": _fixed_param("scheduler.params.last_batch_iteration"),
}
_WARMUP_LR = {
    "warmup_min_lr": Param(_lrs, 0.0, "Learning rate at the start of the warm-up (a number, or one per param "
                                      "group).", auto=0.0),
    "warmup_max_lr": Param(optional(_lrs), None, "Learning rate after the warm-up; default: the optimizer's "
                                                 "learning rate per param group.", auto=AUTO),
    **_WARMUP_COMMON,
}
_TOTAL = Param(integer(1), Param.REQUIRED, "Total number of optimizer steps of the schedule.", no_auto=_STEPS_NO_AUTO)
SCHEDULER_TYPES: Dict[str, Dict[str, Param]] = {
    "WarmupLR": _WARMUP_LR,
    "WarmupDecayLR": {**_WARMUP_LR,
                      "warmup_max_lr": Param(_lrs, 1e-3, "Learning rate after the warm-up (DeepSpeed's default "
                                                         "0.001).", auto=AUTO),
                      "total_num_steps": _TOTAL},
    "WarmupCosineLR": {
        "total_num_steps": _TOTAL,
        "warmup_min_ratio": Param(number(0.0), 0.0, "Start of the warm-up as a fraction of the optimizer's "
                                                    "learning rate (above 1: the warm-up descends from it)."),
        "cos_min_ratio": Param(_finite, 1e-4, "End of the cosine decay as a fraction of the optimizer's learning "
                                              "rate (below 0: the rate reaches 0 before the end and stays there; "
                                              "above 1: it rises to it, as in DeepSpeed)."),
        **_WARMUP_COMMON,
    },
}


def _check_params(spec: Dict[str, Param], params: Any, path: str, kind: str, type_name: str):
    """Validate ``params`` against ``spec``; returns (normalized items with defaults filled, problems)."""
    problems: List[Tuple[str, str]] = []
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        return (), [(path, f"{path} must be an object, got {show(params)}")]
    out: Dict[str, Any] = {}
    for k, v in params.items():
        dotted = f"{path}.{k}"
        if kind == "optimizer" and k == "max_grad_norm":
            problems.append((dotted, f"{dotted} is not an optimizer parameter: use the top-level gradient_clipping"))
            continue
        if k not in spec:
            problems.append((dotted, f"unknown config key {dotted!r} for {kind} {type_name}; supported: "
                                     f"{', '.join(spec)}"))
            continue
        p = spec[k]
        if is_auto(v):
            if p.auto is None:
                problems.append((dotted, f"{dotted} is \"auto\", which deepcompile cannot derive "
                                         f"({p.no_auto or 'it has no derivation here'}); set a value"))
            else:
                out[k] = p.auto
            continue
        try:
            out[k] = p.check(v, dotted)
        except ValueError as e:
            problems.append((dotted, str(e)))
    for k, p in spec.items():
        if k not in out and k not in params:
            if p.default is Param.REQUIRED:
                problems.append((f"{path}.{k}", f"{path}.{k} is required for {kind} {type_name}"))
            else:
                out[k] = p.default
    return tuple(sorted(out.items())), problems


def _type_name(choices: Sequence[str], case_insensitive: bool) -> Check:
    def check(value: Any, dotted: str) -> str:
        if value is None:
            raise ValueError(f"{dotted} is required: one of {', '.join(choices)}")
        if not isinstance(value, str):
            raise ValueError(f"{dotted} must be a string, got {show(value)}")
        for c in choices:
            if value == c or (case_insensitive and value.lower() == c.lower()):
                return c
        hint = difflib.get_close_matches(value, list(choices), n=1)
        hint = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(f"{dotted}={value!r} is not supported{hint}: deepcompile builds {', '.join(choices)}; for "
                         "another one pass it to deepcompile.initialize instead of the config section")
    return check


def _params_field(value: Any, dotted: str):
    # Normalized against the type in _check_together; here only the container is kept hashable.
    if isinstance(value, tuple):
        return value
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(f"{dotted} must be an object, got {show(value)}")
    return ("__raw__", tuple(value.items()))


def _normalize_params(section, spec_of: Dict[str, Dict[str, Param]], kind: str) -> List[Tuple[str, str]]:
    raw = section.params
    params = dict(raw[1]) if raw and raw[0] == "__raw__" else dict(raw)
    items, problems = _check_params(spec_of[section.type], params, section._dotted("params"), kind, section.type)
    object.__setattr__(section, "params", items)
    return problems


def _params_to_dict(params) -> Dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
    """``optimizer``: built by deepcompile when ``initialize`` gets no optimizer object."""

    _path = "optimizer"
    type: str = key(_type_name(tuple(OPTIMIZER_TYPES), True), None,
                    "Adam, AdamW or SGD (any case). Adam honours adam_w_mode (default true: AdamW's update).")
    params: tuple = key(_params_field, (), "The optimizer's hyper-parameters; defaults filled in.")
    legacy_fusion: bool = fixed_key("optimizer.legacy_fusion")

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        if not (valid("type") and valid("params")):
            return []
        problems = _normalize_params(self, OPTIMIZER_TYPES, "optimizer")
        if not problems and self.type == "AdamW" and not self.params_dict()["adam_w_mode"]:
            dotted = self._dotted("params.adam_w_mode")
            problems.append((dotted, f"{dotted}=false contradicts type AdamW (decoupled weight decay); use type Adam "
                                     "for the L2 form"))
        return problems

    def params_dict(self) -> Dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> Dict[str, Any]:
        return {"type": self.type, "params": _params_to_dict(self.params), "legacy_fusion": self.legacy_fusion}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(Section):
    """``scheduler``: a learning-rate schedule stepped once per optimizer step."""

    _path = "scheduler"
    type: str = key(_type_name(tuple(SCHEDULER_TYPES), False), None,
                    "WarmupLR, WarmupDecayLR or WarmupCosineLR, with DeepSpeed's meaning (docs/config.md).")
    params: tuple = key(_params_field, (), "The schedule's parameters; defaults filled in.")

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        if not (valid("type") and valid("params")):
            return []
        return _normalize_params(self, SCHEDULER_TYPES, "scheduler")

    def params_dict(self) -> Dict[str, Any]:
        return dict(self.params)

    def to_dict(self) -> Dict[str, Any]:
        return {"type": self.type, "params": _params_to_dict(self.params)}
