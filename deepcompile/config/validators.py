"""Validators of single values.

A validator takes the value and its full dotted key, returns the normalized value, and raises
``ValueError`` naming the key when the value is invalid. Types are strict: booleans must be
``true``/``false`` (not 0/1 or strings); integers reject booleans and non-integral floats, but
integral floats such as ``5e8`` (common in DeepSpeed configs) are accepted as ints.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from typing import Any, Callable, Iterable, Mapping

from deepcompile.config.errors import show

Check = Callable[[Any, str], Any]


def boolean(value: Any, key: str) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{key} must be true or false, got {show(value)}")
    return value


def boolean_or(word: str) -> Check:
    """true, false, or the one string ``word`` (a third setting, e.g. "planned")."""

    def check(value: Any, key: str) -> Any:
        if type(value) is bool or value == word:
            return value
        raise ValueError(f"{key} must be true, false or {word!r}, got {show(value)}")

    return check


def integer(minimum: int) -> Check:
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")

    def check(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be {what}, got {show(value)}")
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{key} must be {what}, got {value!r}")
            value = int(value)
        if value < minimum:
            raise ValueError(f"{key} must be {what}, got {value!r}")
        return value

    return check


def integer_or_never(minimum: int) -> Check:
    """A period in steps, as :func:`integer`, or positive infinity for "never": ``float("inf")``
    in a dict, ``Infinity`` in a JSON file (Python's json reads it as that float). accelerate
    writes ``steps_per_print: inf`` to silence DeepSpeed's log, and DeepSpeed takes it because
    ``step % inf`` is never 0. No string form: DeepSpeed's own ``%`` fails on one."""
    as_integer = integer(minimum)
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")

    def check(value: Any, key: str) -> Any:
        if isinstance(value, float) and value == math.inf:
            return value
        try:
            return as_integer(value, key)
        except ValueError:
            raise ValueError(f"{key} must be {what} or Infinity (never), got {show(value)}") from None

    return check


def number(low: float, high: float = math.inf, low_open: bool = False) -> Check:
    what = f"a number in ({low}, {high}]" if low_open else f"a number >= {low}"
    if not low_open and high != math.inf:
        what = f"a number in [{low}, {high}]"

    def check(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be {what}, got {show(value)}")
        value = float(value)
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            raise ValueError(f"{key} must be {what}, got {value!r}")
        return value

    return check


def optional(check: Check) -> Check:
    return lambda value, key: None if value is None else check(value, key)


def string(value: Any, key: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null, got {show(value)}")
    return value


def choice(*choices: str) -> Check:
    def check(value: Any, key: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{key} must be one of {', '.join(map(repr, choices))}, got {show(value)}")
        return value

    return check


def off_only(feature: str) -> Check:
    """A DeepSpeed switch for a feature deepcompile lacks: only ``false`` is accepted."""

    def check(value: Any, key: str) -> bool:
        if boolean(value, key):
            raise ValueError(f"{key}: {feature} is not supported yet; set it to false or remove it")
        return False

    return check


def only(expected: Any, why: str) -> Check:
    """A key without effect by design: accepted only with the value that describes the runtime.

    ``why`` says what the runtime does instead; it ends the error message of any other value.
    """
    if isinstance(expected, bool):
        base: Check = boolean
    elif isinstance(expected, int):
        base = integer(-(2**63))
    else:
        base = number(-math.inf)

    def check(value: Any, key: str) -> Any:
        value = base(value, key)
        if value != expected:
            raise ValueError(f"{key}={json.dumps(value)} is not supported: {why}. Only {json.dumps(expected)} "
                             "(or leaving the key out) is accepted")
        return value

    return check


def any_object(value: Any, key: str) -> dict:
    """Any JSON object, kept as a copy (keys whose content nothing reads)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be an object, got {show(value)}")
    return json.loads(json.dumps(dict(value)))


def unknown_key(k: Any, supported: Iterable[str], path: str) -> str:
    supported = list(supported)
    name = f"{path}.{k}" if path else str(k)
    where = f"{path}" if path else "the top level"
    hint = difflib.get_close_matches(str(k), supported, n=1)
    hint = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"unknown config key {name!r}{hint}; supported keys of {where}: {', '.join(supported)}"


def check_keys(d: Mapping, supported, path: str) -> None:
    for k in d:
        if k not in supported:
            raise ValueError(unknown_key(k, supported, path))
