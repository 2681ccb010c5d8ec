"""``deepspeed.utils.logging``: the logger clients set the level of (Lightning's DeepSpeed strategy
does on every run, and logs through it) and the rank-aware helpers scripts log with.

Served under that name from ``utils.py`` (which keeps the module file it always had, so the
standard ``logging`` it uses is imported there under another name).
"""

from __future__ import annotations

import logging
import sys
from typing import Iterable, Optional

import torch.distributed as dist

from deepcompile.integrations.deepspeed_api._missing import module_getattr

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


class LoggerFactory:
    @staticmethod
    def create_logger(name: Optional[str] = None, level: int = logging.INFO) -> logging.Logger:
        """A logger writing to stdout at ``level``, not passing records on to the root logger
        (whose handlers would print them a second time)."""
        if name is None:
            raise ValueError("LoggerFactory.create_logger needs a name")
        created = logging.getLogger(name)
        created.setLevel(level)
        created.propagate = False
        if not created.handlers:
            handler = logging.StreamHandler(stream=sys.stdout)
            handler.setFormatter(logging.Formatter(_FORMAT))
            created.addHandler(handler)
        return created


logger = logging.getLogger("deepcompile.deepspeed_api")


def log_dist(message: str, ranks: Optional[Iterable[int]] = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed (``-1`` among them: on every rank), prefixed with the
    rank. Before the process group exists every process logs, as there are no ranks yet."""
    if not dist.is_initialized():
        logger.log(level, message)
        return
    chosen = set(ranks or ())
    rank = dist.get_rank()
    if -1 in chosen or rank in chosen:
        logger.log(level, f"[Rank {rank}] {message}")


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level lets messages of ``max_log_level_str`` (a level name, e.g.
    "info") through: scripts test it before building costly log text."""
    level = logging.getLevelName(str(max_log_level_str).upper())
    if not isinstance(level, int):
        raise ValueError(f"should_log_le: {max_log_level_str!r} is not a logging level name")
    return logger.getEffectiveLevel() <= level


__getattr__ = module_getattr("deepspeed.utils.logging")
