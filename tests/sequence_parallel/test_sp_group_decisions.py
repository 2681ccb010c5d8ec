"""The sequence-parallel input checks are decided by the group (SequenceParallel.check_inputs).

Each rank used to check its own slice before the group's exchange: with padding in the last slice
only, that rank refused while the others waited in the exchange until the group's timeout; with
slices of 32 and 31 tokens, one rank accepted and the other refused (naming a wrong range), and
the first died on a timeout. Now every rank's verdict is exchanged first: on 2 gloo ranks (4 in the slow suite)
(sequence-parallel groups of 2, and of 4), each faulty input on one rank makes every rank of its
group raise the same error naming that rank, and good slices pass on every rank. A short timeout
makes a rank left waiting fail the test instead of hanging it.
"""

from __future__ import annotations

import pytest
import torch

from _harness.multiproc import run_distributed

LENGTH = 8


def _inputs(case: str, sp_rank: int, sp_size: int, faulty: int):
    positions = (torch.arange(LENGTH) + sp_rank * LENGTH).reshape(1, LENGTH)
    kwargs = {"input_ids": torch.zeros(1, LENGTH, dtype=torch.long), "position_ids": positions,
              "attention_mask": torch.ones(1, LENGTH, dtype=torch.long)}
    if sp_rank != faulty:
        return kwargs
    if case == "padding":
        kwargs["attention_mask"][0, -1] = 0
    elif case == "shorter":
        kwargs["position_ids"] = positions[:, :-1]
        kwargs["input_ids"] = kwargs["input_ids"][:, :-1]
        kwargs["attention_mask"] = kwargs["attention_mask"][:, :-1]
    elif case == "no_positions":
        del kwargs["position_ids"]
    elif case == "numbered_from_zero":
        kwargs["position_ids"] = torch.arange(LENGTH).reshape(1, LENGTH)
    return kwargs


CASES = ("good", "padding", "shorter", "no_positions", "numbered_from_zero")


def _body(ctx):
    for sp_size in sorted({2, ctx.world_size}):
        for case in CASES:
            _check_case(ctx, sp_size, case)


def _check_case(ctx, sp_size: int, case: str):
    from deepcompile.sequence_parallel import SequenceParallel, SequenceParallelError, build_groups

    seq = SequenceParallel(build_groups(sp_size))
    faulty = sp_size - 1 if case != "numbered_from_zero" else 1
    try:
        seq.check_inputs((), _inputs(case, seq.rank, sp_size, faulty))
        message = None
    except SequenceParallelError as error:
        message = str(error)
    finally:
        seq.close()
    everyone = [None] * ctx.world_size
    torch.distributed.all_gather_object(everyone, message)
    group = seq.groups.group_ranks
    assert all(everyone[r] == message for r in group), everyone  # one decision per group
    if case == "good":
        assert message is None
        return
    assert message is not None
    named = f"rank {faulty}: 1 rows of {LENGTH - 1}" if case == "shorter" else f"rank {faulty} (global {group[faulty]})"
    assert named in message, message
    expected = {"padding": "attention_mask with padding", "shorter": "slices differ in shape",
                "no_positions": "got no position_ids", "numbered_from_zero": "not their slice"}[case]
    assert expected in message, message


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"ws{n}")
def test_the_group_decides_together(world_size):
    run_distributed(_body, world_size, timeout=120)
