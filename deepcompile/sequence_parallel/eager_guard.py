"""Every attention call of a sequence-parallel forward is the rewritten one, or the forward refuses.

The Ulysses pass (attention.py) rewrites the attention calls of the graphs Dynamo captures. A call
that runs outside them (a layer under ``torch.compiler.disable``, a graph break, an
activation-checkpointed layer Dynamo could not trace and ran eagerly) would attend over this
rank's slice only: a plausible loss, wrong by a little, and no error. Counting rewritten calls over
the whole model cannot see one such call among rewritten ones.

While any engine with sequence parallelism exists, ``torch.nn.functional.scaled_dot_product_attention``
is a thin wrapper (transformers looks the function up at each call). Under Dynamo's tracing the
wrapper is inlined and calls the original, so captured graphs hold the same node as before and the
pass sees it; eagerly, inside a sequence-parallel engine's forward, it raises before computing.
Outside such a forward (evaluation on whole sequences, other models) it calls the original.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, List, Optional

import torch
import torch.nn.functional as F

from deepcompile.sequence_parallel.attention import SequenceParallelError

_ORIGINAL: Optional[Callable] = None
_owners = 0  # sequence-parallel engines alive
_state = threading.local()  # .depth: sequence-parallel forwards in flight on this thread
_causes: List[str] = []  # what the engine knows may send layers out of the graphs


def _guarded_sdpa(*args, **kwargs):
    if torch.compiler.is_compiling():
        return _ORIGINAL(*args, **kwargs)  # traced: the pass rewrites this node
    if getattr(_state, "depth", 0):
        raise SequenceParallelError(
            "sequence parallelism: an attention call (scaled_dot_product_attention) ran outside the compiled graphs, "
            "where the attention pass cannot split it over the group, so it would attend over this rank's slice "
            "only. A layer under torch.compiler.disable, a graph break inside attention, or an activation-"
            "checkpointed layer Dynamo could not trace runs eagerly (TORCH_LOGS=graph_breaks names the cause)"
            + (f"; {'; '.join(_causes)}" if _causes else ""))
    return _ORIGINAL(*args, **kwargs)


def install() -> None:
    """One more sequence-parallel engine: the wrapper is in place while any exists."""
    global _ORIGINAL, _owners
    if _owners == 0:
        _ORIGINAL = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _guarded_sdpa
    _owners += 1


def note_cause(cause: str) -> None:
    """Something an engine found that would run layers eagerly, named in the error."""
    if cause not in _causes:
        _causes.append(cause)


def uninstall() -> None:
    global _ORIGINAL, _owners
    if _owners == 0:
        return
    _owners -= 1
    if _owners == 0:
        if F.scaled_dot_product_attention is _guarded_sdpa:
            F.scaled_dot_product_attention = _ORIGINAL
        _ORIGINAL = None
        _causes.clear()


@contextlib.contextmanager
def guarding() -> Iterator[None]:
    """The extent of a sequence-parallel forward: eager attention calls raise inside it."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
