"""Sharding layouts of ``bench/train_bench.py``'s deepcompile rows, and the bytes per link of a
row's last step.

A layout says how a deepcompile row partitions its state (docs/design/hybrid_sharding.md):

* ``plain``: ZeRO over the whole world (no key set: the config the rows always had);
* ``RxS``: hybrid sharding, R replicas of shard groups of S consecutive ranks
  (``zero_optimization.mics_shard_size: S``); R * S must be the world size, so that a layout
  written for 2 GPUs is not silently another one on 4. ``1xW`` is plain ZeRO, ``Wx1`` leaves
  every rank a full replica (only the replica all-reduce communicates);
* ``hpzH``: ZeRO++ hpZ, a secondary copy of ZeRO-3's parameter shards over H ranks
  (``zero_optimization.zero_hpz_partition_size: H``; ZeRO-3 only);
* ``RxS+hpzH``: both.

The bench passes the keys through and leaves their validation to deepcompile's config: a layout
the build refuses gives its row an error saying why. ``--shard-group-size`` and
``--hpz-partition-size`` give every deepcompile row one layout; ``--layouts plain,2x1,hpz2`` gives
every deepcompile method one row per layout; ``--methods z3@2x1`` names one row's layout. Peer rows
(FSDP2, DDP, DeepSpeed) have no layout. Rows with a layout carry it in their label
(``deepcompile ZeRO-3 + prefetch [2x1]``), so that rows of one call can be told apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

SEPARATOR = "@"  # "z3-prefetch@2x1": the method key, then the row's layout
# The links engine.step_report.comm_bytes names: shard group, replica group, hpZ's secondary group.
LINKS = ("shard", "replica", "secondary")
COMM_COLUMN = "GB/step shard/replica/secondary"


@dataclasses.dataclass(frozen=True)
class Layout:
    shard_group_size: int = -1  # zero_optimization.mics_shard_size; -1: the whole world
    hpz_partition_size: int = 1  # zero_optimization.zero_hpz_partition_size; 1: off
    replicas: Optional[int] = None  # R where the layout was written RxS (checked against the world)

    @property
    def is_plain(self) -> bool:
        return self.shard_group_size == -1 and self.hpz_partition_size == 1

    def label(self) -> str:
        parts = []
        if self.replicas is not None:
            parts.append(f"{self.replicas}x{self.shard_group_size}")
        elif self.shard_group_size != -1:
            parts.append(f"shard group {self.shard_group_size}")
        if self.hpz_partition_size != 1:
            parts.append(f"hpZ {self.hpz_partition_size}")
        return ", ".join(parts) or "plain"

    def zero_keys(self) -> Dict[str, int]:
        """What the layout adds to ``zero_optimization`` (nothing for plain: the row's config is
        exactly the one it had before layouts existed)."""
        keys: Dict[str, int] = {}
        if self.shard_group_size != -1:
            keys["mics_shard_size"] = self.shard_group_size
        if self.hpz_partition_size != 1:
            keys["zero_hpz_partition_size"] = self.hpz_partition_size
        return keys

    def world_error(self, world: int) -> Optional[str]:
        """Why this layout cannot run on ``world`` ranks as written (RxS only; the config checks
        that a shard group size divides the world)."""
        if self.replicas is not None and self.replicas * self.shard_group_size != world:
            return (f"layout {self.label()} needs {self.replicas * self.shard_group_size} ranks "
                    f"({self.replicas} replicas x shard groups of {self.shard_group_size}), this run has {world}")
        return None


def parse(token: str) -> Layout:
    """``plain``, ``RxS``, ``hpzH`` or ``RxS+hpzH`` (case-insensitive); ValueError on anything else."""
    text = token.strip().lower()
    if text == "plain":
        return Layout()
    fields: Dict[str, int] = {}
    for part in text.split("+"):
        hybrid, hpz = re.fullmatch(r"(\d+)x(\d+)", part), re.fullmatch(r"hpz(\d+)", part)
        if hybrid and "shard_group_size" not in fields:
            fields["replicas"], fields["shard_group_size"] = int(hybrid.group(1)), int(hybrid.group(2))
        elif hpz and "hpz_partition_size" not in fields:
            fields["hpz_partition_size"] = int(hpz.group(1))
        else:
            raise ValueError(f"layout {token!r}: expected plain, RxS (e.g. 2x1), hpzH (e.g. hpz2) or RxS+hpzH")
    if any(v < 1 for v in fields.values()):
        raise ValueError(f"layout {token!r}: sizes must be >= 1")
    return Layout(**fields)


def from_options(args: argparse.Namespace) -> Layout:
    """The layout ``--shard-group-size`` / ``--hpz-partition-size`` give (plain by default)."""
    return Layout(getattr(args, "shard_group_size", -1), getattr(args, "hpz_partition_size", 1))


def split_key(key: str) -> Tuple[str, Optional[str]]:
    """``"z3@2x1"`` -> ``("z3", "2x1")``; ``"z3"`` -> ``("z3", None)``."""
    base, sep, token = key.partition(SEPARATOR)
    return base, (token if sep else None)


def row_layout(key: str, args: argparse.Namespace) -> Layout:
    """The layout of the row ``key``: its own (``@...``) or the options'."""
    token = split_key(key)[1]
    return parse(token) if token is not None else from_options(args)


def with_layout(args: argparse.Namespace, layout: Layout) -> argparse.Namespace:
    """``args`` as the options of a run with this layout (what a deepcompile row's config reads)."""
    return argparse.Namespace(**{**vars(args), "shard_group_size": layout.shard_group_size,
                                 "hpz_partition_size": layout.hpz_partition_size, "layout_replicas": layout.replicas})


def expand(keys: Sequence[str], layouts: Optional[Sequence[str]], layered: Iterable[str]) -> List[str]:
    """The method keys with ``--layouts``: each key of ``layered`` (the deepcompile methods) that
    names no layout of its own becomes one key per layout, in the order given; others stay."""
    layered = set(layered)
    out: List[str] = []
    for key in keys:
        base, token = split_key(key)
        if layouts and token is None and base in layered:
            out += [f"{base}{SEPARATOR}{t}" for t in layouts]
        else:
            out.append(key)
    return out


def check(parser: argparse.ArgumentParser, args: argparse.Namespace, keys: Sequence[str],
          stages: Dict[str, Optional[int]]) -> None:
    """parse_args' checks (``parser.error`` on a bad one). ``stages``: each method key's ZeRO stage,
    None for the peers, which take no layout."""
    if args.shard_group_size == 0 or args.shard_group_size < -1:
        parser.error("--shard-group-size must be -1 (plain ZeRO) or a positive number of ranks")
    if args.hpz_partition_size < 1:
        parser.error("--hpz-partition-size must be >= 1 (1: off)")
    if args.layouts is not None and not from_options(args).is_plain:
        parser.error("give either --layouts or --shard-group-size/--hpz-partition-size (a layout of --layouts "
                     "says both: RxS+hpzH)")
    for token in args.layouts or ():
        try:
            parse(token)
        except ValueError as e:
            parser.error(f"--layouts: {e}")
    for key in keys:
        base, token = split_key(key)
        if token is not None and stages.get(base) is None:
            parser.error(f"--methods {key}: layouts apply to deepcompile rows only, {base} is a peer row")
        try:
            layout = row_layout(key, args)
        except ValueError as e:
            parser.error(f"--methods {key}: {e}")
        if layout.hpz_partition_size != 1 and stages.get(base) in (1, 2):
            parser.error(f"--methods {key}: hpZ (--hpz-partition-size, layout hpzH) is ZeRO-3 only, {base} is "
                         f"ZeRO-{stages[base]}; name the ZeRO-3 rows' layouts one by one instead (e.g. "
                         f"--methods z3@hpz2,{base})")
        if args.isolate and not args.child_json and layout.world_error(args.nproc):
            parser.error(f"--methods {key}: {layout.world_error(args.nproc)} (--nproc)")


def world_errors(keys: Sequence[str], args: argparse.Namespace, world: int) -> List[str]:
    """The rows whose RxS layout does not match the world size of this run."""
    out = []
    for key in keys:
        error = row_layout(key, args).world_error(world)
        if error:
            out.append(f"{key}: {error}")
    return out


# ------------------------------------------------------------------------------------- bytes per link


def comm_cell(comm_bytes: Optional[Dict[str, Dict[str, int]]]) -> str:
    """The last step's bytes per link in GB (1e9): what this rank sends on the link under ring
    algorithms (``wire``), "-" for a link the row does not have; "n/a" without counts."""
    if not comm_bytes:
        return "n/a"
    cells = [_gb(comm_bytes[link]["wire"]) if link in comm_bytes else "-" for link in LINKS]
    # A link of another name (a later engine's) is shown with its name rather than dropped.
    cells += [f"{link} {_gb(counted['wire'])}" for link, counted in comm_bytes.items() if link not in LINKS]
    return " / ".join(cells)


def _gb(nbytes: float) -> str:
    gb = nbytes / 1e9
    return format(gb, ".2f") if gb >= 1 or gb == 0 else format(gb, ".3g")  # tiny CPU models: 3 digits
