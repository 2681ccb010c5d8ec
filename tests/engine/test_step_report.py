"""``steps_per_print``: the line rank 0 logs, and the global gradient norm (issue 17, item 4).

Against single-process training on the same global batches (fp32, the parity models):

* ``engine.step()`` returns, and ``engine.get_global_grad_norm()`` reads, the global L2 norm of the
  step's gradients before clipping: what ``torch.nn.utils.clip_grad_norm_`` returns in one
  process, whether or not ``gradient_clipping`` is set, for ZeRO-1, 2 and 3;
* every ``steps_per_print`` optimizer steps rank 0 logs, through ``logging``, the step, the
  learning rate, the loss (the mean loss of that step's accumulation window over all ranks, which
  is the single-process loss of the global batch), that norm, tokens/s (the tokens of all ranks
  since the previous line: the elements of the ``input_ids``-like argument, or ``tokens=`` given
  to ``backward``) and the peak memory ("n/a" on the CPU); the other ranks log nothing.

Tolerance: the sharded gradients are summed in another order than the single-process ones (fp32),
the same 1e-5 relative as the ZeRO parity suites.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model, make_optimizer

WORLD = single_world_size()
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
RTOL = 1e-5
STEPS, EVERY, SEQ = 4, 2, 8  # optimizer steps, steps_per_print, tokens per sequence ("llama" batches)


def reference(gas, clip, device):
    """Single process: per optimizer step, (mean loss of its micro-steps, pre-clip global norm)."""
    model = build_model("llama", device=device)
    opt = make_optimizer(list(model.parameters()))
    out, losses = [], []
    for micro in range(STEPS * gas):
        loss = model(*batch("llama", micro, device=device))
        (loss / gas).backward()
        losses.append(loss.item())
        if (micro + 1) % gas == 0:
            norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip if clip > 0 else float("inf"))
            opt.step()
            opt.zero_grad()
            out.append((sum(losses) / gas, norm.item()))
            losses = []
    return out


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _body(ctx, stage, gas, clip, explicit_tokens):
    import deepcompile

    torch._dynamo.reset()
    logger = logging.getLogger("deepcompile")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = build_model("llama", device=ctx.device)
        cfg = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64}, "steps_per_print": EVERY,
               "gradient_accumulation_steps": gas, "gradient_clipping": clip}
        engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
        assert engine.get_global_grad_norm() is None  # before the first step
        rank, n = ctx.rank, GLOBAL_BATCH // ctx.world_size
        returned, read, logged = [], [], {}
        for micro in range(STEPS * gas):
            tokens, targets = batch("llama", micro, device=ctx.device)
            loss = engine(tokens[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n])
            engine.backward(loss, **({"tokens": torch.tensor(5)} if explicit_tokens else {}))
            norm = engine.step()
            if (micro + 1) % gas:
                assert norm is None  # not an optimizer step
                continue
            returned.append(norm.item())
            read.append(engine.get_global_grad_norm())
            if engine.global_steps % EVERY == 0:
                logged[engine.global_steps] = dict(engine.step_report.last_values)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)

    want = reference(gas, clip, ctx.device)
    torch.testing.assert_close(returned, [w[1] for w in want], rtol=RTOL, atol=0)
    assert read == returned  # get_global_grad_norm() reads what step() returned
    if clip > 0:
        assert max(returned) > clip, "the norm reported is the one before clipping; make clipping bind"

    lr = engine.get_lr()[0]
    per_micro = 5 * ctx.world_size if explicit_tokens else GLOBAL_BATCH * SEQ
    for step, values in logged.items():
        loss, norm = want[step - 1]
        assert values["loss"] == pytest.approx(loss, rel=RTOL)
        assert values["grad_norm"] == pytest.approx(norm, rel=RTOL)
        assert values["tokens"] == per_micro * gas * EVERY  # every micro-step since the previous line
        assert values["tokens_per_s"] > 0
        assert values["peak_memory_bytes"] is None if ctx.device.type == "cpu" else values["peak_memory_bytes"] > 0
    if rank != 0:
        assert handler.lines == []
        engine.destroy()
        return
    # The run summary (run_summary.py) comes first, once; then the step lines.
    summary, *handler.lines = handler.lines
    assert summary.startswith("deepcompile engine: ZeRO-"), summary
    assert len(handler.lines) == STEPS // EVERY, handler.lines
    memory = r"n/a" if ctx.device.type == "cpu" else r"\d+\.\d\d GiB"
    pattern = (r"step (\d+): lr ([\d.e-]+) \| loss ([\d.]+) \| grad norm ([\d.e+-]+) \| tokens/s (\d+) \| "
               rf"peak memory {memory}$")
    for line, (step, values) in zip(handler.lines, sorted(logged.items())):
        m = re.fullmatch(pattern, line)
        assert m, line
        assert int(m[1]) == step and float(m[2]) == pytest.approx(lr, rel=1e-5)
        assert float(m[3]) == pytest.approx(values["loss"], abs=5e-5)  # printed with 4 decimals
        assert float(m[4]) == pytest.approx(values["grad_norm"], rel=5e-4)  # 4 significant digits
        assert abs(int(m[5]) - values["tokens_per_s"]) <= 0.5
    engine.destroy()


@pytest.mark.parametrize("stage,gas,clip,explicit_tokens", [
    (3, 1, 0.0, False), (3, 2, 0.05, True), (2, 2, 0.0, False), (1, 1, 0.05, False),
])
def test_steps_per_print_logs_loss_lr_grad_norm_tokens_and_memory(stage, gas, clip, explicit_tokens):
    run_distributed(_body, WORLD, args=(stage, gas, clip, explicit_tokens), timeout=300)
