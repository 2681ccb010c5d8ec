"""Packed sequences under sequence parallelism (compile.packed_sequences).

The op on its own (one process): ``dcsp::packed_attention`` against SDPA with the block-causal mask
written out, forward and gradients, packed and unpacked rows, grouped-query heads, fp32 and bf16;
and the documents transformers' rule gives for restarting positions.

Through the engine (world size 2, gloo): a real transformers Llama trained with SP 2 on packed rows
(positions restarting inside each row, several documents, one crossing the slice boundary) against
one process on the whole rows, where transformers itself builds the block-causal mask from the
positions. ZeRO-3 eager, ZeRO-2 on Inductor with gradient accumulation, per-layer graphs with
checkpointing and the step in the backward. On one rank without sequence parallelism (the causal-mask
pass makes the position-derived mask the packed op), with checkpointing. Broken on
purpose in both: the documents hidden from the
op (every row one document), so attention crosses document boundaries, and the comparison must
fail. Without the key a packed batch is refused.

Tolerances: those of test_sequence_parallel_parity.py (the same float reorderings: attention over
the same tokens per head, per-slice means recombined); the op against SDPA in fp32 1e-5, in bf16
the rounding of one bf16 attention (2e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _harness.multiproc import run_distributed
from _harness.parity_cases import RunResult, assert_parity, make_optimizer

SEQUENCE = 16
BATCH = 2
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-6)
INDUCTOR_TOL = dict(rtol=1e-4, atol=1e-5)


def packed_positions(batch: int = BATCH, length: int = SEQUENCE) -> torch.Tensor:
    """Rows of several documents: [5, 7, 4] and [3, 13] tokens at 16 (one document crossing the middle)."""
    splits = ([5, 7, 4], [3, 13])
    rows = [torch.cat([torch.arange(n) for n in splits[r % 2]]) for r in range(batch)]
    assert all(len(r) == length for r in rows)
    return torch.stack(rows)


def test_documents_follow_transformers_rule():
    from transformers.masking_utils import find_packed_sequence_indices

    from deepcompile.sequence_parallel.documents import documents_of

    positions = packed_positions()
    docs = documents_of(positions)
    assert torch.equal(docs.ids.long(), find_packed_sequence_indices(positions).long())
    assert docs.counts.tolist() == [5, 13] and docs.packed
    assert docs.bounds[:6].tolist() == [0, 5, 12, 16, 19, 32] and set(docs.bounds[6:].tolist()) == {32}
    unpacked = documents_of(torch.arange(SEQUENCE).expand(BATCH, SEQUENCE))
    assert unpacked.counts.tolist() == [BATCH, SEQUENCE] and not unpacked.packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_op_matches_sdpa_with_the_block_causal_mask(dtype, packed, kv_heads):
    from deepcompile import ops
    from deepcompile.sequence_parallel.documents import documents_of

    torch.manual_seed(0)
    positions = packed_positions() if packed else torch.arange(SEQUENCE).expand(BATCH, SEQUENCE)
    docs = documents_of(positions)
    q = torch.randn(BATCH, 4, SEQUENCE, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(BATCH, kv_heads, SEQUENCE, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    out, _ = ops.packed_attention(q, k, v, docs.ids, docs.bounds, docs.counts, 0.3)
    grad = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))

    ids = docs.ids
    mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool).tril()
    ref_out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None], scale=0.3,
                                             enable_gqa=kv_heads != 4)
    ref = (ref_out, *torch.autograd.grad(ref_out, (q, k, v), grad.float()))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name}: {m}")
    if packed:  # the mask matters: plain causal attention differs
        causal = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.3,
                                                enable_gqa=kv_heads != 4)
        assert not torch.allclose(causal, ref_out, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cuda_op_matches_sdpa_and_refuses_fp32(packed, kv_heads):
    """CUDA: flash attention's variable-length kernel, bf16, against fp32 SDPA with the mask written
    out (tolerance: bf16 inputs and output, 2e-2)."""
    from deepcompile import ops
    from deepcompile.sequence_parallel.documents import documents_of

    torch.manual_seed(0)
    positions = packed_positions() if packed else torch.arange(SEQUENCE).expand(BATCH, SEQUENCE)
    docs = documents_of(positions.cuda())
    assert docs.counts.device.type == "cpu"
    q = torch.randn(BATCH, 4, SEQUENCE, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (torch.randn(BATCH, kv_heads, SEQUENCE, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            for _ in range(2))
    out, _ = ops.packed_attention(q, k, v, docs.ids, docs.bounds, docs.counts, 0.125)
    grad = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ids = docs.ids
    mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool,
                                                             device="cuda").tril()
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref_out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask[:, None], scale=0.125,
                                             enable_gqa=kv_heads != 4)
    ref = (ref_out, *torch.autograd.grad(ref_out, (qf, kf, vf), grad.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        ops.packed_attention(q.float(), k.float(), v.float(), docs.ids, docs.bounds, docs.counts, 0.125)


def packed_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, 61, (BATCH, SEQUENCE), generator=g)


def train_reference(steps: int, optimizer: str, gas: int = 1) -> RunResult:
    """One process, whole packed rows: transformers builds the block-causal mask from the positions."""
    import test_sequence_parallel_parity as parity

    return parity.train_reference(steps, 1, optimizer, gas=gas, batch=packed_batch, position_ids=packed_positions())


def train_packed(stage: int, optimizer: str, *, backend: str = "eager", gas: int = 1, regional: bool = False,
                 checkpointing: bool = False, compile_extra=None, documents_seen=(5, 13)) -> RunResult:
    import deepcompile
    from test_sequence_parallel_parity import tiny_llama_sdpa

    torch._dynamo.reset()
    model = tiny_llama_sdpa()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 256}, "sequence_parallel_size": 2,
              "gradient_accumulation_steps": gas, "compile": {"packed_sequences": True, **(compile_extra or {})}}
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), optimizer), config)
    engine.compile(backend=backend, regional=regional)
    seq = engine.sequence_parallel
    losses, norms = [], []
    try:
        for step in range(STEPS * gas):
            tokens = packed_batch(step)
            local = seq.shard({"input_ids": tokens, "labels": tokens, "position_ids": packed_positions()})
            loss = seq.loss(engine(**local, use_cache=False).loss, local["shift_labels"])
            assert tuple(seq.last_documents.counts.tolist()) == documents_seen, seq.last_documents.counts
            engine.backward(loss)
            norm = engine.step()
            if norm is not None:
                norms.append(norm.item())
            losses.append(loss.item())  # the global-token mean: the same on both ranks
        params = {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}
        assert seq.rewritten_calls == (1 if regional else 2), seq.rewritten_calls
        return RunResult(losses, params, norms)
    finally:
        engine.destroy()


def _refused_without_the_key():
    import deepcompile
    from deepcompile.sequence_parallel import SequenceParallelError
    from test_sequence_parallel_parity import tiny_llama_sdpa

    torch._dynamo.reset()
    model = tiny_llama_sdpa()
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), "sgd_momentum"),
                                    {"zero_optimization": {"stage": 3}, "sequence_parallel_size": 2})
    engine.compile(backend="eager")
    try:
        local = engine.sequence_parallel.shard({"input_ids": packed_batch(0), "position_ids": packed_positions()})
        with pytest.raises(SequenceParallelError, match="compile.packed_sequences"):
            engine(**local, use_cache=False)
    finally:
        engine.destroy()


def _packed_body(ctx):
    cases = [(3, "adamw", {}),
             (2, "sgd_momentum", {"backend": "inductor", "gas": 2}),
             (3, "adamw", {"regional": True, "checkpointing": True,
                           "compile_extra": {"optimizer_step_in_backward": True}})]
    for stage, optimizer, features in cases:
        got = train_packed(stage, optimizer, **features)
        ref = train_reference(STEPS * features.get("gas", 1), optimizer, features.get("gas", 1))
        tol = INDUCTOR_TOL if features.get("backend") == "inductor" else TOL
        try:
            assert_parity(got, ref, **tol)
        except AssertionError as e:
            raise AssertionError(f"ZeRO-{stage}, {optimizer}, {features}: {e}") from None
    # Broken on purpose: the op told every row is one document (plain causal attention over the
    # whole sequence, what the pass does without the key); parity must fail.
    from deepcompile.sequence_parallel import documents

    original = documents.documents_of
    documents.documents_of = lambda positions: original(torch.arange(positions.shape[1]).expand_as(positions))
    try:
        broken = train_packed(3, "sgd_momentum", documents_seen=(BATCH, SEQUENCE))
    finally:
        documents.documents_of = original
    with pytest.raises(AssertionError):
        assert_parity(broken, train_reference(STEPS, "sgd_momentum"), **TOL)
    _refused_without_the_key()
    dist.barrier()


@pytest.mark.world_size(2)
def test_packed_rows_under_sequence_parallel_match_one_process():
    run_distributed(_packed_body, world_size=2, timeout=600)


def train_one_rank(checkpointing: bool, backend: str = "eager") -> RunResult:
    """compile.packed_sequences without sequence parallelism: the causal-mask pass turns the mask
    transformers traces from position_ids into the packed attention op."""
    import deepcompile
    from test_sequence_parallel_parity import tiny_llama_sdpa

    torch._dynamo.reset()
    model = tiny_llama_sdpa()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), "sgd_momentum"),
                                    {"zero_optimization": {"stage": 3}, "compile": {"packed_sequences": True}})
    engine.compile(backend=backend)
    losses, norms = [], []
    try:
        for step in range(STEPS):
            tokens = packed_batch(step)
            loss = engine(input_ids=tokens, labels=tokens, position_ids=packed_positions(), use_cache=False).loss
            engine.backward(loss)
            norms.append(engine.step().item())
            losses.append(loss.item())
        assert (engine.causal_masks.packed, engine.causal_masks.elided) == (2, 0), vars(engine.causal_masks)
        params = {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}
        return RunResult(losses, params, norms)
    finally:
        engine.destroy()


def _one_rank_body(ctx):
    ref = train_reference(STEPS, "sgd_momentum")
    # (Inductor with the op: the SP 2 test's ZeRO-2 case)
    assert_parity(train_one_rank(checkpointing=True), ref, **TOL)
    from deepcompile.sequence_parallel import documents

    original = documents.documents_of
    documents.documents_of = lambda positions: original(torch.arange(positions.shape[1]).expand_as(positions))
    try:
        broken = train_one_rank(checkpointing=True)
    finally:
        documents.documents_of = original
    with pytest.raises(AssertionError):
        assert_parity(broken, ref, **TOL)


@pytest.mark.world_size(1)
def test_packed_rows_without_sequence_parallelism_match_one_process():
    run_distributed(_one_rank_body, world_size=1, timeout=600)
