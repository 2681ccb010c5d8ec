"""The ZeRO-3 runtime ops cost no Inductor fusion.

Inductor does not fuse generated kernels across a fallback call such as ``dc.wait_allgather`` or
``dc.release_param``. Placed naively (the wait right before the first reader, the release on the
last reader's output) they split every RMSNorm from the residual add before it and the norm's
backward into three kernels. ZeRO-2 has no gather or release at all, so on the same model the
two stages generate the same kernels, but one: ZeRO-3 stores the embedding lookup, which
Inductor would otherwise recompute after the embedding weight's release. Runs on CPU (C++ kernels) and, with
``DC_TEST_DEVICE=cuda``, on a GPU (Triton kernels).

The backend partitions the joint graph itself, so it must also run the joint-graph passes that
Inductor's own partitioner runs: without them the backward of a bf16 language model materialises
the loss gradient as an fp32 copy of the logits (on the benchmark's Llama 0.5 GiB per rank, the
whole margin by which ZeRO-3's peak memory exceeded FSDP2's).
"""

from __future__ import annotations

import re

import pytest
import torch

from _harness.multiproc import run_distributed

# One rank: the kernel counts of a graph do not depend on the world size.
pytestmark = pytest.mark.world_size(1)  # the world size in every test id (conftest.py)


def _generated_kernels(ctx, stage: int) -> int:
    import deepcompile
    from torch._inductor import config as inductor_config
    from torch._inductor import metrics
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(ctx.device)
    config = {
        # Threshold 0: every parameter, the norm weights included, is partitioned and goes
        # through gather/wait/release, the case with the most runtime ops.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": 2,
        "compile": {"prefetch": False, "selective_gather": False},
    }
    engine = deepcompile.initialize(model, torch.optim.AdamW(model.parameters()), config)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    metrics.reset()
    # A cache hit would generate no code, and count nothing.
    with inductor_config.patch(fx_graph_cache=False):
        engine.compile(backend="inductor")
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
    count = metrics.generated_kernel_count
    engine.destroy()
    return count


def _body(ctx):
    zero2 = _generated_kernels(ctx, stage=2)
    zero3 = _generated_kernels(ctx, stage=3)
    assert zero2 > 0, "no kernels counted: the compile produced no code"
    # One kernel more, by design: the embedding lookup is stored before the embedding weight's
    # release. Its result is read again by the residual add after the attention, and Inductor
    # would recompute the lookup there, from the released weight (passes/zero3.py, _inline_region).
    assert zero3 == zero2 + 1, (f"ZeRO-3's runtime ops split fusion regions: {zero3} kernels against ZeRO-2's "
                                f"{zero2} (+1 expected: the stored embedding lookup)")


def test_zero3_generates_as_many_kernels_as_zero2():
    run_distributed(_body, world_size=1, timeout=600)


_VOCAB, _BATCH, _SEQ = 1000, 2, 64


def _logit_sized_buffers(ctx, stage: int):
    """(shape, dtype) of every buffer with as many elements as the logits in the code Inductor
    generates for one bf16 training step."""
    import deepcompile
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=_VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=_SEQ,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device=ctx.device, dtype=torch.bfloat16)
    config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
              "train_micro_batch_size_per_gpu": _BATCH, "compile": {"prefetch": False, "selective_gather": False}}
    engine = deepcompile.initialize(model, torch.optim.AdamW(model.parameters()), config)
    tokens = torch.randint(0, _VOCAB, (_BATCH, _SEQ), generator=torch.Generator().manual_seed(1)).to(ctx.device)

    def step():
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)

    with inductor_config.patch(fx_graph_cache=False):
        engine.compile(backend="inductor")
        _, sources = run_and_get_code(step)
    engine.destroy()
    found = []
    for source in sources:
        for match in re.finditer(r"empty_strided_\w+\(\(([\d, ]+)\),[^)]*\), (torch\.\w+)\)", source):
            dims = [int(d) for d in match.group(1).split(",") if d.strip()]
            if dims and torch.Size(dims).numel() == _BATCH * _SEQ * _VOCAB:
                found.append((tuple(dims), match.group(2)))
    return found


def _loss_gradient_body(ctx):
    for stage in (2, 3):
        buffers = _logit_sized_buffers(ctx, stage)
        assert buffers, f"ZeRO-{stage}: no logit-sized buffer found: the code scan no longer matches Inductor's output"
        fp32 = [b for b in buffers if b[1] == "torch.float32"]
        assert not fp32, f"ZeRO-{stage}: the generated code materialises fp32 logit-sized buffers {fp32} (all: {buffers})"


def test_loss_gradient_is_not_materialised_in_fp32():
    run_distributed(_loss_gradient_body, world_size=1, timeout=600)
