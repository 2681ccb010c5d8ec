"""Peer rows of ``bench/train_bench.py`` run more than once in a call (``--peer-repeats``), and the
options a row process of ``--isolate`` gets.

A peer's step time can differ by a quarter between calls of the same code (FSDP2 + compile: 86 to
114 ms on the same 1B model), so a single row per call can flatter or wrong a comparison. The
repeated rows keep the method's name and carry their run number (``Row.repeat``), so the ratios
to a peer still find it and the table says which run each row is.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence


def repeat_peers(args: argparse.Namespace, peers: Sequence[str]) -> List[str]:
    """``args.methods`` with each key of ``peers`` given ``--peer-repeats`` times in a row; a row
    process of ``--isolate`` (``--child-json``) runs its one row once."""
    times = 1 if args.child_json else args.peer_repeats
    return [k for key in args.methods for k in [key] * (times if key in peers else 1)]


def number_repeats(rows) -> None:
    """A method with several rows gets each row's run number (1, 2, ...) in ``repeat``; a method
    with one row keeps none."""
    names = [r.method for r in rows]
    seen: Dict[str, int] = {}
    for r in rows:
        if names.count(r.method) > 1 and r.repeat is None:
            seen[r.method] = r.repeat = seen.get(r.method, 0) + 1


def row_argv(argv: Sequence[str]) -> List[str]:
    """What a row process of ``--isolate`` is given: the parent's options less ``--nproc`` (the
    parent's own; torchrun's parser refuses it even after the script, as an ambiguous prefix of its
    ``--nproc-per-node``, so ``--isolate --nproc 2`` gave every row "ambiguous option")."""
    out: List[str] = []
    drop_next = False
    for a in argv:
        if not drop_next and a != "--nproc" and not a.startswith("--nproc="):
            out.append(a)
        drop_next = a == "--nproc"
    return out
