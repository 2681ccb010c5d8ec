"""The rows of ``bench/train_bench.py`` as data: each ``--methods`` key names its label, the peer
family whose runner module builds it and that runner's options. Adding a row is one line here;
adding a peer family is one runner module (a ``runner(ctx, **options) -> Runner``) and one entry
of ``FAMILIES``.

| family | runner module | options |
| --- | --- | --- |
| ``deepcompile`` | ``run_deepcompile.py`` | ``stage``, ``passes``, ``offload``, ``regional``, ``offload_passes`` |
| ``torch`` | ``run_torch.py`` | ``peer`` (``fsdp2``, ``ddp``), ``cpu_offload`` |
| ``deepspeed`` | ``deepspeed_peer.py`` | ``key`` (its ``VARIANTS``) |
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Callable, Dict, Mapping, Optional, Tuple

import deepspeed_peer  # DeepSpeed's rows; imports DeepSpeed only when one is built
import layouts
import run_deepcompile
import run_torch
from train_core import Context, Runner

FSDP2_NAME = "FSDP2 + compile"  # the peer the compile-time ratio is taken against
FSDP2_OFFLOAD_NAME = "FSDP2 + CPU offload + compile"  # the peer of the offload rows' speed-up

# A peer family: the function that builds one of its rows from the row's options.
FAMILIES: Dict[str, Callable[..., Runner]] = {
    "deepcompile": run_deepcompile.runner,
    "torch": run_torch.runner,
    "deepspeed": deepspeed_peer.runner,
}

_OFFLOAD = dict(stage=3, offload_passes=True)  # the deepcompile offload rows: passes from --offload-passes
# key: (row label, family, options). The table follows the order of --methods; 'all' is this order.
ROWS: Dict[str, Tuple[str, str, Mapping[str, object]]] = {
    "z3": ("deepcompile ZeRO-3", "deepcompile", dict(stage=3)),
    "z3-prefetch": ("deepcompile ZeRO-3 + prefetch", "deepcompile", dict(stage=3, passes=("prefetch",))),
    "z3-auto": ("deepcompile ZeRO-3 + prefetch + selective", "deepcompile",
                dict(stage=3, passes=("prefetch", "selective_gather"))),
    "z3-prefetch-regional": ("deepcompile ZeRO-3 + prefetch, per layer", "deepcompile",
                             dict(stage=3, passes=("prefetch",), regional=True)),
    "z1": ("deepcompile ZeRO-1", "deepcompile", dict(stage=1)),
    "z2": ("deepcompile ZeRO-2", "deepcompile", dict(stage=2)),
    "fsdp2": (FSDP2_NAME, "torch", dict(peer="fsdp2")),
    "fsdp2-offload": (FSDP2_OFFLOAD_NAME, "torch", dict(peer="fsdp2", cpu_offload=True)),
    "z3-offload": ("deepcompile ZeRO-3 + offload_optimizer", "deepcompile", dict(_OFFLOAD, offload="optimizer")),
    "z3-offload-budget": ("deepcompile ZeRO-3 + offload_opt_states, budget", "deepcompile",
                          dict(_OFFLOAD, offload="budget")),
    "z3-offload-all": ("deepcompile ZeRO-3 + all offload kinds, budget", "deepcompile", dict(_OFFLOAD, offload="all")),
    "ddp": ("DDP + compile", "torch", dict(peer="ddp")),
    **{key: (name, "deepspeed", dict(key=key)) for key, name in deepspeed_peer.ROWS.items()},
}
DEFAULT_METHODS = ["z3", "z3-prefetch", "z3-auto", "z1", "z2", "fsdp2", "ddp"]
OFFLOAD_KEYS = ("z3-offload", "z3-offload-budget", "z3-offload-all", "fsdp2-offload")
# --peer-repeats runs each of these that many times in one call (their step times vary from run to run).
REPEATED_PEERS = ("fsdp2", *deepspeed_peer.ROWS)


@dataclasses.dataclass(frozen=True)
class Method:
    name: str  # the row label
    build: Callable[[Context], Runner]
    key: str = ""  # the --methods key
    stage: Optional[int] = None  # deepcompile rows: the ZeRO stage (they take a layout); peers: None
    layout: Optional[str] = None  # the row's layout label (bench/layouts.py), where it has one
    family: str = ""  # the peer family of a row of ROWS (FAMILIES), "" for a method built elsewhere
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)  # its runner's options


def _method(key: str, name: str, family: str, options: Mapping[str, object]) -> Method:
    return Method(name, functools.partial(FAMILIES[family], **options), key=key,
                  stage=options["stage"] if family == "deepcompile" else None, family=family, options=dict(options))


METHODS: Dict[str, Method] = {key: _method(key, *row) for key, row in ROWS.items()}


def method_of(key: str, args: argparse.Namespace) -> Method:
    """The row of a ``--methods`` key: ``METHODS[key]``, or, for a deepcompile row with a layout
    (its own, ``z3@2x1``, or the options' --shard-group-size/--hpz-partition-size), that method
    built with the layout and labelled with it (bench/layouts.py)."""
    base, token = layouts.split_key(key)
    m = METHODS[base]
    if m.stage is None or (token is None and layouts.from_options(args).is_plain):
        return m  # a peer, or a deepcompile row as it always was
    layout = layouts.row_layout(key, args)

    def build(ctx: Context) -> Runner:
        error = layout.world_error(ctx.world)
        if error:
            raise ValueError(error)
        return m.build(dataclasses.replace(ctx, args=layouts.with_layout(ctx.args, layout)))

    return dataclasses.replace(m, name=f"{m.name} [{layout.label()}]", build=build, key=key, layout=layout.label())
