"""Errors raised on every rank together.

A checkpoint step that fails on one rank (a missing directory on a node, a full disk, a model
that does not match) must not leave the other ranks waiting in the next collective. Each step
runs locally under :func:`agreed`, then one ``all_gather_object`` tells every rank which ranks
failed and why, and every rank raises the same :class:`CheckpointError`.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank with the same message."""


def _message(error: BaseException) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    if isinstance(error, CheckpointException):
        # DCP's own agreement: the ranks where it failed, without its tracebacks.
        return "; ".join(f"rank {r} in torch.distributed.checkpoint: {type(e).__name__}: {e}"
                         for r, (e, _) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


def _describe(failures: List[Tuple[int, str]], world: int) -> str:
    messages = sorted({m for _, m in failures})
    if len(messages) == 1:
        ranks = [r for r, _ in failures]
        where = "every rank" if len(ranks) == world else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        return f"{messages[0]} (on {where})"
    return "; ".join(f"rank {r}: {m}" for r, m in failures)


def agreed(what: str, fn: Callable[[], T], group: Optional[dist.ProcessGroup] = None) -> T:
    """``fn()`` on this rank; raises :class:`CheckpointError` on every rank if it raised on any.
    Collective. ``what`` names the step in the error (``"save_checkpoint"``)."""
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except (Exception, CheckpointException) as e:  # reported to every rank below (DCP's is a BaseException)
        error = e
    mine = None if error is None else _message(error)
    reports: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    failures = [(r, m) for r, m in enumerate(reports) if m is not None]
    if failures:
        raise CheckpointError(f"{what}: {_describe(failures, len(reports))}") from error
    return result  # type: ignore[return-value]
