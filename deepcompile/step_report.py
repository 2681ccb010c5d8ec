"""``steps_per_print`` and ``wall_clock_breakdown``: what rank 0 logs about the training loop.

Every ``steps_per_print`` optimizer steps rank 0 logs one line to the ``deepcompile`` logger at
INFO level (shown on stderr when the program configured no logging: logging_setup.py)::

    step 20: lr 0.001 | loss 2.3456 | grad norm 0.8123 | tokens/s 51234 | peak memory 12.34 GiB

* ``loss``: the loss of that optimizer step: the mean of the losses passed to
  ``engine.backward`` in its accumulation window, averaged over the ranks (with equal
  micro-batches per rank, the loss of the global batch);
* ``grad norm``: the global L2 norm of that step's gradients before clipping
  (``engine.get_global_grad_norm()``);
* ``loss scale`` (fp16 only): the loss scale that step's gradients carried (``precision/``); a
  step skipped for an overflow shows an inf or nan grad norm;
* ``tokens/s``: tokens trained on by all ranks since the previous line, over the wall time since
  then. A micro-step's tokens are the elements of the forward's ``input_ids`` argument, else of
  its first integer tensor argument, unless ``engine.backward(loss, tokens=n)`` gives them; "n/a"
  when no micro-step had any;
* ``peak memory``: ``torch.cuda.max_memory_allocated`` of rank 0's device since the start (never
  reset: other measurements may rely on it); "n/a" on the CPU.

Nothing here synchronises the host with the device between two lines: losses, token counts and
the norm stay device tensors and are summed on the device; at a line, one all-reduce of four
numbers (loss sum, micro-steps, tokens, micro-steps with a token count) brings them to the host.
Every rank takes part in it, so every rank must run the same optimizer steps (as it must anyway).

With ``wall_clock_breakdown`` the engine also times its forward, backward and optimizer step, each
between two device synchronizations (otherwise asynchronous CUDA work would be charged to whatever
waits next), and the same line gives the mean milliseconds per optimizer step of each phase since
the previous line. Without it nothing is timed and nothing is synchronized.

``comm_bytes``: the bytes of the training collectives in the last optimizer step (from the end of
the step before it), per link: ``{"shard": {...}, "replica": {...}}``, the replica link only under
hybrid sharding. The runtime's counters (``runtime.comm_bytes``) plus what the stage issues itself
through torch.distributed (ZeRO-1/2's all-gather of the updated partitions, counted in the shard
link's ``all_gather`` and ``wire``; ``Sharding.take_comm_bytes``), so it is the whole step's
traffic (docs/design/hybrid_sharding.md). Host counters only: reading them waits for nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

log = logging.getLogger("deepcompile")

PHASES = ("forward", "backward", "step")


def tokens_in(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[int]:
    """The tokens of one forward's inputs: the elements of ``input_ids``, else of the first
    integer tensor among the positional then keyword arguments; None when there is none."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
                and value.dtype != torch.bool:
            return value.numel()
    return None


@dataclasses.dataclass(frozen=True)
class PhaseSeconds:
    """Seconds of each phase per optimizer step (``wall_clock_breakdown``'s timings)."""

    forward: float
    backward: float
    step: float


class StepReport:
    def __init__(self, steps_per_print: int, wall_clock_breakdown: bool, rank: int, device: torch.device):
        self.every = steps_per_print
        self.timing = wall_clock_breakdown
        self.rank = rank
        self.device = device
        self._started: Dict[str, float] = {}
        self.totals_ms: Dict[str, float] = {p: 0.0 for p in PHASES}
        self._steps_in_window = 0
        self.last_line: Optional[str] = None  # the last line logged (tests read it)
        self.last_values: Dict[str, Any] = {}  # the numbers of the last line, on every rank
        self.comm_bytes: Optional[Dict[str, Dict[str, int]]] = None  # the last optimizer step's (see above)
        # The current accumulation window's losses (device sum) and micro-steps.
        self._window_loss: Optional[torch.Tensor] = None
        self._window_micro_steps = 0
        # Tokens since the previous line: host-known counts, device counts, and how many
        # micro-steps had a count at all.
        self._forward_tokens: Optional[int] = None
        self._tokens_host = 0
        self._tokens_device: Optional[torch.Tensor] = None
        self._counted_micro_steps = 0
        self._since: Optional[float] = None  # perf_counter at the previous line (or first forward)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self, phase: str) -> None:
        if self.timing:
            self._sync()
            self._started[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.timing and phase in self._started:
            self._sync()
            self.totals_ms[phase] += (time.perf_counter() - self._started.pop(phase)) * 1e3

    def phase_seconds(self) -> Optional[PhaseSeconds]:
        """Each phase's seconds per optimizer step since the last step line (what the offload
        plan weighs its copies against); None without ``wall_clock_breakdown`` or before a step."""
        n = self._steps_in_window
        if not self.timing or n == 0:
            return None
        per_step = {p: ms / 1e3 / n for p, ms in self.totals_ms.items()}
        return PhaseSeconds(per_step["forward"], per_step["backward"], per_step["step"])

    # ---- what each micro-step contributes ------------------------------------------------------

    def count_tokens(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """A forward is about to run on these inputs."""
        if self._since is None:
            self._since = time.perf_counter()
        self._forward_tokens = tokens_in(args, kwargs)

    def after_micro_step(self, loss: torch.Tensor, tokens: Union[int, torch.Tensor, None] = None) -> None:
        """``engine.backward(loss, tokens)``: no host synchronisation."""
        value = loss.detach().float().mean()
        self._window_loss = value if self._window_loss is None else self._window_loss + value
        self._window_micro_steps += 1
        if tokens is None:
            tokens, self._forward_tokens = self._forward_tokens, None
        if tokens is None:
            return
        self._counted_micro_steps += 1
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().to(device=self.device, dtype=torch.float64).sum()
            self._tokens_device = tokens if self._tokens_device is None else self._tokens_device + tokens
        else:
            self._tokens_host += int(tokens)

    # ---- at each optimizer step ---------------------------------------------------------------

    def after_optimizer_step(self, global_step: int, lrs: List[float], grad_norm: Optional[torch.Tensor] = None,
                             group: Optional[dist.ProcessGroup] = None, loss_scale: Optional[float] = None) -> None:
        """Called on every rank once per optimizer step with the new step count, the learning
        rates and the step's gradient norm; every ``steps_per_print`` steps all ranks reduce the
        numbers and rank 0 logs them. ``loss_scale``: fp16's loss scale at this step (logged when
        given)."""
        self._steps_in_window += 1
        window_loss, window_n = self._window_loss, self._window_micro_steps
        self._window_loss, self._window_micro_steps = None, 0
        if global_step % self.every:
            return
        loss_sum, micro_steps, tokens, counted, norm = self._reduce(window_loss, window_n, grad_norm, group)
        now = time.perf_counter()
        elapsed = now - self._since if self._since is not None else 0.0
        self._since = now
        values: Dict[str, Any] = {
            "step": global_step,
            "lr": list(lrs),
            "loss": loss_sum / micro_steps if micro_steps else None,
            "grad_norm": norm,
            "tokens": tokens if counted else None,  # all ranks', since the previous line
            "tokens_per_s": tokens / elapsed if counted and elapsed > 0 else None,
            "peak_memory_bytes": (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                                  else None),
        }
        line = f"step {global_step}: lr {', '.join(f'{lr:.6g}' for lr in lrs)}"
        line += f" | loss {_fmt(values['loss'], '.4f')} | grad norm {_fmt(norm, '.4g')}"
        if loss_scale is not None:
            values["loss_scale"] = loss_scale
            line += f" | loss scale {loss_scale:g}"
        line += f" | tokens/s {_fmt(values['tokens_per_s'], '.0f')}"
        peak = values["peak_memory_bytes"]
        line += f" | peak memory {peak / 2**30:.2f} GiB" if peak is not None else " | peak memory n/a"
        if self.timing:
            n = self._steps_in_window
            values["ms_per_step"] = {p: self.totals_ms[p] / n for p in PHASES}
            line += " | ms per step: " + " | ".join(f"{p} {self.totals_ms[p] / n:.2f}" for p in PHASES)
            self.totals_ms = {p: 0.0 for p in PHASES}
        self._steps_in_window = 0
        self.last_values = values
        if self.rank == 0:
            self.last_line = line
            log.info(line)

    def _reduce(self, window_loss: Optional[torch.Tensor], window_n: int, grad_norm: Optional[torch.Tensor],
                group: Optional[dist.ProcessGroup]) -> List[Optional[float]]:
        """(loss sum, micro-steps, tokens, counted micro-steps) summed over the ranks, and the
        norm (the same on every rank): one all-reduce and one host synchronisation."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = zero + self._tokens_host
        if self._tokens_device is not None:
            tokens = tokens + self._tokens_device
        packed = torch.stack([
            window_loss.to(device=self.device, dtype=torch.float64) if window_loss is not None else zero,
            zero + window_n, tokens, zero + self._counted_micro_steps,
        ])
        self._tokens_host, self._tokens_device, self._counted_micro_steps = 0, None, 0
        if dist.is_initialized():
            dist.all_reduce(packed, group=group)
        norm = (grad_norm.detach().to(device=self.device, dtype=torch.float64).reshape(1) if grad_norm is not None
                else torch.full((1,), float("nan"), dtype=torch.float64, device=self.device))
        out = torch.cat([packed, norm]).tolist()
        return out[:4] + [None if grad_norm is None else out[4]]


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
