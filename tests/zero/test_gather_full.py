"""zero/gather_full.py: the tensors handed to a gloo gather stay referenced after it returns.

gloo finishes a collective on a worker thread that drops its own references after the caller's
wait has returned. Where the caller has already let go of a tensor, the worker's reference is the
last one and freeing the tensor needs the GIL; if the rank exits right after (save_model at the end
of a Trainer run), the worker can reach that point while the interpreter finalizes and the
process aborts ("terminate called without an active exception", seen in CI). The invariant
tested here, on both sides of the gather: once the iterator is exhausted, the tensors of the last
gather are still referenced from Python, so the worker never holds the last reference."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from deepcompile.zero import gather_full
from deepcompile.zero.param_shard import ParamShard


class _FakeGroupOfTwo:
    """dist.* as gather_to_rank calls them, for a group of two ranks seen from ``rank``; the
    gather keeps no reference (as gloo's caller-side handle does not, once waited on)."""

    def __init__(self, rank, other_piece):
        self.rank, self.other_piece = rank, other_piece
        self.passed = []  # weak references to every tensor handed to gather

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return 2

    def get_global_rank(self, group, rank):
        return rank

    def all_gather_object(self, out, obj, group=None):
        out[self.rank] = obj
        out[1 - self.rank] = [(4, 6)] if self.rank == 0 else [(0, 4)]

    def gather(self, tensor, gather_list=None, dst=0, group=None):
        self.passed = [weakref.ref(tensor)] + [weakref.ref(t) for t in (gather_list or [])]
        if gather_list is not None:
            gather_list[self.rank].copy_(tensor)
            gather_list[1 - self.rank][: self.other_piece.numel()].copy_(self.other_piece)


@pytest.mark.parametrize("rank", [0, 1], ids=["destination", "sender"])
def test_the_last_gather_s_tensors_are_still_referenced_after_the_iterator_ends(monkeypatch, rank):
    full = torch.arange(6, dtype=torch.float32)
    mine = full[:4] if rank == 0 else full[4:]
    other = full[4:] if rank == 0 else full[:4]
    start, end = (0, 4) if rank == 0 else (4, 6)
    fake = _FakeGroupOfTwo(rank, other)
    monkeypatch.setattr(gather_full, "dist", fake)
    shard = ParamShard(name="w", ds_id=0, shape=torch.Size([2, 3]), local=mine.clone(), start=start, end=end)

    out = list(gather_full.gather_to_rank([shard], lambda s: torch.float32, group=None, dst=0))

    if rank == 0:
        torch.testing.assert_close(out[0][1], full.view(2, 3), rtol=0, atol=0)
    else:
        assert out[0][1] is None
    del out
    gc.collect()
    assert fake.passed and all(ref() is not None for ref in fake.passed), \
        "a tensor handed to the last gather is no longer referenced: gloo's worker may free it at exit"
