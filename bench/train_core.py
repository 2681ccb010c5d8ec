"""What every row of ``bench/train_bench.py`` shares, whatever builds it: the run's context, the
model and its batches, the ``Runner`` a row's builder returns, and the clean-up between rows.

A runner module (``run_deepcompile.py``, ``run_torch.py``, ``deepspeed_peer.py``) imports this one
and nothing else of the bench's table; the rows table (``train_rows.py``) imports the runners.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `import deepcompile` must be this checkout (the one being benchmarked), not another installed copy.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

GIB = 1024**3


@dataclasses.dataclass
class Context:
    """What every method needs: the run's options, the device and the pre-generated batches."""

    args: argparse.Namespace
    device: torch.device
    backend: str
    rank: int
    world: int
    batches: List[torch.Tensor]  # (micro_batch, seq) token ids, one per step, this rank's slice
    n_params: int  # parameters of the model, for the FLOP count

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, attn_implementation="sdpa",
        use_cache=False,  # training: no KV cache objects in the traced graph
    )


def count_params(args: argparse.Namespace) -> int:
    """Parameters of the model (tied ones once), counted on the meta device: no memory, no init."""
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(args))
    return sum(p.numel() for p in model.parameters())


def flops_per_token(args: argparse.Namespace, n_params: int) -> float:
    return 6 * n_params + 12 * args.layers * args.hidden * args.seq


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(ctx: Context, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh model, built directly on the device in ``dtype`` (no fp32 copy first, so the peak
    memory of a bf16 method is not inflated by construction), identical on every rank."""
    torch.manual_seed(ctx.args.seed)
    with torch.device(ctx.device), default_dtype(dtype):
        model = LlamaForCausalLM(model_config(ctx.args))
    # Same seed gives the same weights on every rank already; the broadcast makes it a guarantee
    # (FSDP2 and deepcompile ZeRO-3 shard whatever each rank holds).
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    model.train()
    return model


def build_meta_model(ctx: Context, dtype: torch.dtype) -> torch.nn.Module:
    """The model on the ``meta`` device (no memory): ``--init meta``."""
    with torch.device("meta"), default_dtype(dtype):
        model = LlamaForCausalLM(model_config(ctx.args))
    model.train()
    return model


def init_local_shards(model: torch.nn.Module, init_fn: Callable[[torch.nn.Module], None]) -> None:
    """Run ``init_fn(module)`` for every module of an FSDP2-sharded model after ``to_empty``, on each
    parameter's local shard (plain tensors, so no DTensor random op is involved; the shard is a view
    of FSDP2's storage, written in place). With one rank the shard is the whole parameter; with
    several each rank initialises its rows with its own generator (a different, equally valid
    random model). Norm weights (ones) and rotary buffers come out exact either way."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for module in model.modules():
            sharded = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
            for name, p in sharded.items():
                module._parameters[name] = torch.nn.Parameter(p.to_local(), requires_grad=False)
            try:
                init_fn(module)
            finally:
                module._parameters.update(sharded)


def make_optimizer(ctx: Context, params) -> torch.optim.Optimizer:
    # The same optimizer (torch's default implementation for the device) for every method.
    return torch.optim.AdamW(params, lr=ctx.args.lr)


def make_batches(args: argparse.Namespace, rank: int, device: torch.device) -> List[torch.Tensor]:
    """Random token ids, different per rank and step (``--same-batch``: per rank only), identical for
    every method."""
    out = []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + (0 if args.same_batch else step) * 1009 + rank)
        out.append(torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device))
    return out


class Unavailable(Exception):
    """A method that cannot run in this build or on this device; the message is the reason."""


@dataclasses.dataclass
class Runner:
    """One method, set up: ``step(tokens)`` runs forward + backward + optimizer step and returns
    the loss (not synchronised); ``note()`` says anything worth a note after the run; ``close()``
    releases what only an explicit call can release."""

    step: Callable[[torch.Tensor], torch.Tensor]
    close: Callable[[], None] = lambda: None
    note: Callable[[], str] = lambda: ""
    # True once the step just run was a step of the method's final plan, run compiled (not
    # profiled): the profile-guided ZeRO-3 rows profile, re-plan and recompile first.
    scheduled: Callable[[], bool] = lambda: True
    # The bytes per link of the step just run (deepcompile: engine.step_report.comm_bytes), or None.
    comm_bytes: Callable[[], Optional[Dict[str, Dict[str, int]]]] = lambda: None



def sync(ctx: Context) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def teardown(ctx: Context) -> None:
    """Leave nothing of the previous method behind: compiled code, cached blocks, garbage."""
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
    dist.barrier()

