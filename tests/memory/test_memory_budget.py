"""The memory budget (deepcompile/memory/budget.py): one rule, agreed over the ranks, and the
one number the engine hands to every planner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepcompile.memory.budget import MemoryBudget, local_memory_budget, memory_budget
from _harness.multiproc import run_distributed


def _compile(budget_bytes=None, fraction=0.9):
    return SimpleNamespace(memory_budget_bytes=budget_bytes, memory_budget_fraction=fraction)


def test_configured_bytes_are_the_budget_on_any_device():
    # A configured byte count never reads the device (a CUDA device that is absent here too).
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        b = local_memory_budget(_compile(1 << 30), device)
        assert b == MemoryBudget(1 << 30, "compile.memory_budget_bytes") and b.limited


def test_a_cpu_device_without_configured_bytes_has_no_budget():
    b = local_memory_budget(_compile(None, 0.5), torch.device("cpu"))
    assert b.bytes is None and not b.limited and "none" in b.source


def test_a_cuda_device_budget_is_the_fraction_of_its_capacity(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=1000))
    b = local_memory_budget(_compile(None, 0.25), torch.device("cuda", 0))
    assert b.bytes == 250 and "0.25" in b.source


def test_every_planner_reads_the_budget_it_is_handed():
    from deepcompile.config import Config
    from deepcompile.offload.activations import ActivationMemory
    from deepcompile.offload.settings import opt_state_offload_settings

    handed = MemoryBudget(12345, "the engine's")
    cfg = Config.from_any({"zero_optimization": {"stage": 3}, "compile": {"offload_opt_states": True}})
    s = opt_state_offload_settings(cfg, torch.device("cpu"), handed)
    assert (s.budget_bytes, s.budget_name) == (12345, "the engine's")
    mem = ActivationMemory(SimpleNamespace(free_activation=True, free_activation_threshold=0, offload_activation=False,
                                           memory_budget_bytes=None, memory_budget_fraction=0.9),
                           torch.device("cpu"), handed)
    assert (mem.budget, mem.budget_name) == (12345, "the engine's")


def _agree_body(ctx, local_limits):
    import torch.distributed as dist

    agreed = memory_budget(_compile(local_limits[ctx.rank]), ctx.device, dist.group.WORLD)
    known = [b.bytes for b in (local_memory_budget(_compile(x), ctx.device) for x in local_limits) if b.limited]
    assert agreed.bytes == (min(known) if known else None), (ctx.rank, agreed)
    mine = local_memory_budget(_compile(local_limits[ctx.rank]), ctx.device)
    if mine.bytes != agreed.bytes:
        assert "another rank" in agreed.source, agreed


@pytest.mark.world_size(2)
@pytest.mark.parametrize("limits", [(3 << 20, 1 << 20), (None, 2 << 20), (None, None)],
                         ids=["smallest", "one-without", "none"])
def test_ranks_with_different_limits_agree_on_the_smallest(limits):
    run_distributed(_agree_body, world_size=2, args=(limits,))
