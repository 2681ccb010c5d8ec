"""The schema machinery: a config section is a frozen dataclass whose fields carry their validator
and documentation, so the dataclass *is* the table of the section's keys.

``field.metadata``: ``"check"`` (the validator), ``"doc"``, ``"auto"`` (how an ``"auto"`` value is
derived, or None) and ``"no_auto"`` (why it cannot be, for the error). Validation runs in
``__post_init__``, so direct construction and ``dataclasses.replace`` are validated too, and every
problem of a section is reported at once.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple

from deepcompile.config import inert
from deepcompile.config.errors import ConfigError, is_auto, show
from deepcompile.config.validators import Check, off_only, only, unknown_key


def key(check: Check, default: Any = dataclasses.MISSING, doc: str = "", factory: Any = dataclasses.MISSING,
        auto: Optional[str] = None, no_auto: Optional[str] = None):
    """A config key: its validator, default and documentation.

    ``auto``: how an ``"auto"`` value is derived (the value is kept as ``"auto"`` until
    ``Config.resolve`` replaces it); None: ``"auto"`` is an error, explained by ``no_auto``.
    """
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"check": check, "doc": doc, "auto": auto, "no_auto": no_auto})


def fixed_key(dotted: str):
    """A key of ``inert.FIXED_VALUE``: accepted only with its one value, which is the default."""
    value, why = inert.FIXED_VALUE[dotted]
    return key(only(value, why), value, f"Only {_json(value)}: {why}.")


def off_only_key(dotted: str):
    """A key of ``inert.OFF_ONLY``: a missing feature's switch, accepted only as false."""
    feature = inert.OFF_ONLY[dotted]
    return key(off_only(feature), False, f"Only false: {feature} is not supported.")


def inert_key(dotted: str, check: Check, default: Any):
    """A key of ``inert.INERT``: validated, without effect."""
    return key(check, default, f"{inert.INERT[dotted]}: validated only, no effect.")


def no_effect_key(dotted: str, check: Check, default: Any, auto: Optional[str] = None):
    """A key of ``inert.NO_EFFECT``: any valid value, none changes what happens."""
    return key(check, default, f"No effect by design, any value: {inert.NO_EFFECT[dotted]}.", auto=auto)


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


class Section:
    """Base of every section dataclass."""

    _path = ""  # dotted path of the section in the JSON config; "" for the top level
    _aliases: Dict[str, str] = {}  # DeepSpeed's alternative spellings: alias -> key
    # Keys whose own spelling, when given (not null), is the one read, its aliases then being
    # ignored with a warning: DeepSpeed reads such a key and looks at the old name only without it
    # (``bf16`` before ``bfloat16``). Every other alias is a second name of the same field, whose
    # spellings must agree (see from_dict).
    _key_wins: FrozenSet[str] = frozenset()

    def __post_init__(self) -> None:
        problems: List[Tuple[str, str]] = []
        for f in dataclasses.fields(self):
            dotted = self._dotted(f.name)
            value = getattr(self, f.name)
            if is_auto(value) and f.metadata["auto"] is None:
                why = f.metadata["no_auto"] or "nothing in the model or the world size determines it"
                problems.append((dotted, f"{dotted} is \"auto\", which deepcompile cannot derive ({why}); set a value"))
                continue
            if is_auto(value):
                continue  # kept as "auto" until Config.resolve
            try:
                object.__setattr__(self, f.name, f.metadata["check"](value, dotted))
            except ConfigError as e:
                problems.extend(e.problems)
            except ValueError as e:
                problems.append((dotted, str(e)))
        failed = {k for k, _ in problems}
        problems.extend(self._check_together(lambda name: self._dotted(name) not in failed))
        if problems:
            raise ConfigError(problems)

    def _dotted(self, name: str) -> str:
        return f"{self._path}.{name}" if self._path else name

    def _check_together(self, valid: Callable[[str], bool]) -> List[Tuple[str, str]]:
        """Checks that involve several keys of the section; ``valid(name)``: that key passed its own check."""
        return []

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        if not isinstance(d, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        problems: List[Tuple[str, str]] = []
        kwargs: Dict[str, Any] = {}
        prefix = f"{cls._path}." if cls._path else ""
        given: Dict[str, List[Tuple[str, Any]]] = {}  # key -> (spelling, value) in the order written
        for k, v in d.items():
            target = cls._aliases.get(k, k) if isinstance(k, str) else k
            if target not in names:
                problems.append((f"{prefix}{k}", unknown_key(k, names, cls._path)))
            else:
                given.setdefault(target, []).append((k, v))
        for target, spellings in given.items():
            spellings = cls._read_spellings(target, spellings, prefix)
            (first, value), rest = spellings[0], spellings[1:]
            for k, v in rest:
                # DeepSpeed refuses a second spelling whatever its value; one value under two
                # names is accepted here (nothing is ambiguous), two values are not.
                if v != value:
                    problems.append((f"{prefix}{k}", f"{prefix}{k} and {prefix}{first} name the same setting "
                                                     f"({prefix}{target}) with different values ({show(v)} and "
                                                     f"{show(value)}); keep one"))
            kwargs[target] = value
        try:
            obj = cls(**kwargs)
        except ConfigError as e:
            problems.extend(e.problems)
        if problems:
            raise ConfigError(problems)
        return obj

    @classmethod
    def _read_spellings(cls, target: str, spellings: List[Tuple[str, Any]], prefix: str) -> List[Tuple[str, Any]]:
        """The spellings of ``target`` that count, as DeepSpeed reads them: for a key in
        ``_key_wins``, its own spelling alone when given (not null); otherwise every spelling but
        those holding ``"auto"`` when another holds a value (DeepSpeed drops ``"auto"`` values
        before reading a section, so the other spelling's value stands)."""
        if len(spellings) == 1:
            return spellings
        if target in cls._key_wins:
            own = [(k, v) for k, v in spellings if k == target and v is not None]
            if own:
                for k, v in spellings:
                    if k != target and v != own[0][1]:
                        warnings.warn(f"{prefix}{k} is ignored: {prefix}{target} is given too, and DeepSpeed reads "
                                      f"{prefix}{k} only without it")
                return own
            spellings = [(k, v) for k, v in spellings if k != target]  # null: as if absent
        concrete = [(k, v) for k, v in spellings if not is_auto(v)]
        return concrete or spellings

    def to_dict(self) -> Dict[str, Any]:
        return {
            f.name: v.to_dict() if isinstance(v, Section) else v
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
        }


def section(cls: type) -> Check:
    """The validator of a nested section: an object parsed by ``cls.from_dict``."""

    def check(value: Any, dotted: str):
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{dotted} must be an object, got {show(value)}")
        return cls.from_dict(value)

    return check
