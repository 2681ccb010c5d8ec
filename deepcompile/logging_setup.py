"""What a run prints when its script configured no logging: rank 0's progress lines on stderr.

The package logs through the ``deepcompile`` logger (and its children). Python shows nothing
below WARNING unless the program configures ``logging``, so without this module a run would be
silent: no ``steps_per_print`` line, no word of the first compile or of the schedule switch.
:func:`show_progress` gives the ``deepcompile`` logger a handler on stderr the first time an
engine is built, but only when the program has configured nothing itself:

* rank 0 logs at INFO (the step lines, the compile and schedule lines); the other ranks at
  WARNING, so that N ranks do not print N copies of every line;
* ``DEEPCOMPILE_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or ``OFF``) sets rank 0's
  level (the other ranks never go below WARNING): ``WARNING`` quiets a run, ``OFF`` silences it;
* a program that configured logging keeps its configuration: a handler on the root logger or on
  the ``deepcompile`` logger, or a level set on the ``deepcompile`` logger, means nothing here is
  touched, and so is a level the program sets on it after an engine added the handler. A
  program that configures the root logger *later* (``logging.basicConfig`` after
  ``initialize``) takes over too: the handler added here then stays quiet, so no line is printed
  twice.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "deepcompile"
LEVEL_ENV = "DEEPCOMPILE_LOG_LEVEL"
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "WARN": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL, "OFF": logging.CRITICAL + 10}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each line (a test or a notebook may
    have replaced it since the handler was made), and steps aside once the program has set up the
    root logger itself."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("[deepcompile] %(message)s"))
        self.level_set = logging.NOTSET  # the logger level show_progress set last

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler assigns it in __init__; the property wins
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            return False  # the program configured logging after us: its handlers show the line
        return super().filter(record)


def _ours(logger: logging.Logger):
    return next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)


def _user_configured(logger: logging.Logger) -> bool:
    ours = _ours(logger)
    if ours is not None:
        # Ours, unless the program has set the logger's level since we did.
        return logger.level != ours.level_set
    return bool(logging.getLogger().handlers or logger.handlers or logger.level != logging.NOTSET)


def requested_level(rank: int) -> int:
    """The level for ``rank``: ``DEEPCOMPILE_LOG_LEVEL`` (default INFO) on rank 0, never below
    WARNING elsewhere. An unknown value raises, naming the accepted ones."""
    name = os.environ.get(LEVEL_ENV, "INFO").strip().upper() or "INFO"
    if name not in _LEVELS:
        raise ValueError(f"{LEVEL_ENV}={os.environ[LEVEL_ENV]!r}: expected one of {', '.join(_LEVELS)}")
    level = _LEVELS[name]
    return level if rank == 0 else max(level, logging.WARNING)


def show_progress(rank: int) -> bool:
    """Give the ``deepcompile`` logger a stderr handler for ``rank`` unless the program configured
    logging (module docstring). Returns whether the handler is in place. Idempotent: a second
    engine in the same process reuses the handler (and the level follows its rank)."""
    logger = logging.getLogger(LOGGER_NAME)
    if _user_configured(logger):
        return False
    level = requested_level(rank)
    ours = _ours(logger)
    if ours is None:
        ours = _StderrHandler()
        logger.addHandler(ours)
    logger.setLevel(level)
    ours.level_set = level
    return True


def remove_handler() -> None:
    """Undo :func:`show_progress` (tests; a program that wants the package silent again)."""
    logger = logging.getLogger(LOGGER_NAME)
    ours = [h for h in logger.handlers if isinstance(h, _StderrHandler)]
    for h in ours:
        logger.removeHandler(h)
    if ours:
        logger.setLevel(logging.NOTSET)
