"""What every config module shares: the ``"auto"`` marker and the error that lists every problem."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

AUTO = "auto"


class ConfigError(ValueError):
    """Everything wrong with a config: ``problems`` is a list of ``(dotted key, message)``."""

    def __init__(self, problems: Sequence[Tuple[str, str]]):
        self.problems: List[Tuple[str, str]] = list(problems)
        # A problem of several keys is one problem under each key; the text says it once.
        messages = list(dict.fromkeys(m for _, m in self.problems))
        if len(messages) == 1:
            text = messages[0]
        else:
            text = f"{len(messages)} problems in the config:\n" + "\n".join(f"  - {m}" for m in messages)
        super().__init__(text)

    @property
    def keys(self) -> List[str]:
        return [k for k, _ in self.problems]


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def show(value: Any) -> str:
    """A value and its type, for error messages (``5 (int)``)."""
    return f"{value!r} ({type(value).__name__})"
