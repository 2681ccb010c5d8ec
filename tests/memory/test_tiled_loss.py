"""compile.tiled_loss: ``dcloss::linear_cross_entropy`` against the untiled loss, and the pass on a
real transformers graph. (Training parity, with and without sequence parallelism, is in
tests/sequence_parallel/test_sequence_parallel_parity.py.)

Tolerances. The loss is fp32 either way, and tiling only reorders its sum over tokens: 1e-6
relative. Gradients, fp32: the same formula (softmax minus one-hot) in another order of operations
than autograd's log-softmax backward: 1e-5 relative, 1e-6 absolute for entries near zero. bf16:
each gradient is computed in fp32 and rounded to bf16 once on both sides (before and after the
matmuls), so the two differ by at most a few bf16 roundings (2**-8 relative each) of the largest
entry: 2**-6 of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _harness.captured_pass import run_with_pass
from deepcompile import ops
from deepcompile.passes import tiled_loss


def _case(dtype, tokens=37, features=16, vocab=50):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, features, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, features, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[[3, 10, 36]] = -100  # ignored, one of them in the last (partial) chunk
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_loss_matches_the_untiled_loss_and_gradients(dtype, reduction):
    hidden, weight, labels = _case(dtype)
    ref = F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100, reduction=reduction)
    ref_h, ref_w = torch.autograd.grad(ref, (hidden, weight))
    got = ops.linear_cross_entropy(hidden, weight, labels, -100, reduction, 8)  # 37 tokens: 4 chunks of 8, one of 5
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
    else:
        for mine, theirs in ((got_h, ref_h), (got_w, ref_w)):
            assert (mine.float() - theirs.float()).abs().max() <= theirs.float().abs().max() * 2**-6


def test_every_label_ignored_gives_nan_mean_and_zero_gradients_as_torch_does():
    hidden, weight, labels = _case(torch.float32)
    labels[:] = -100
    got = ops.linear_cross_entropy(hidden, weight, labels, -100, "mean", 8)
    ref = F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100)
    assert got.isnan() and ref.isnan()
    summed = ops.linear_cross_entropy(hidden, weight, labels, -100, "sum", 8)
    grad_h, grad_w = torch.autograd.grad(summed, (hidden, weight))
    assert summed == 0 and not grad_h.any() and not grad_w.any()


def test_bad_shapes_and_reductions_are_refused():
    hidden, weight, labels = _case(torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        ops.linear_cross_entropy(hidden, weight, labels, -100, "none", 8)
    with pytest.raises(ValueError, match="labels"):
        ops.linear_cross_entropy(hidden, weight, labels[:-1], -100, "mean", 8)


def test_auto_chunk_keeps_a_chunk_of_fp32_logits_within_the_limit():
    for vocab in (61, 32000, 128256):
        chunk = tiled_loss.chunk_tokens(vocab, 0)
        assert chunk * vocab * 4 <= tiled_loss.AUTO_CHUNK_BYTES < (chunk + 1) * vocab * 4
    assert tiled_loss.chunk_tokens(128256, 7) == 7


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def test_the_pass_replaces_a_transformers_loss_and_stands_in_for_its_logits():
    model = _tiny_llama()
    tokens = torch.randint(0, 61, (2, 12))
    ref = model(input_ids=tokens, labels=tokens, use_cache=False)
    seen = []

    def backend(gm, example_inputs):
        seen.append(tiled_loss.TiledLoss(5).rewrite(gm))
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert ops.LINEAR_CROSS_ENTROPY in targets and F.cross_entropy not in targets
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(input_ids=tokens, labels=tokens, use_cache=False)
    assert seen == [1]
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
    assert out.logits.shape == ref.logits.shape and out.logits.dtype == ref.logits.dtype
    assert out.logits.isnan().all() and set(out.logits.stride()) == {0}  # no memory behind it
    torch._dynamo.reset()


def test_the_pass_leaves_weighted_or_smoothed_losses_alone():
    weight = torch.randn(7, 4)

    def smoothed(h, y):
        return F.cross_entropy(F.linear(h, weight).float(), y, label_smoothing=0.1)

    def class_weighted(h, y):
        return F.cross_entropy(F.linear(h, weight).float(), y, weight=torch.ones(7))

    for fn in (smoothed, class_weighted):
        counts = []

        def backend(gm, example_inputs):
            counts.append(tiled_loss.tile_losses(gm, 4))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(fn, backend=backend)(torch.randn(5, 4), torch.randint(0, 7, (5,)))
        assert counts == [0], fn.__name__
    torch._dynamo.reset()


@pytest.mark.parametrize("budget,expected", [(None, 0), (10**9, 0), (10**5, 1)])
def test_planned_tiles_the_loss_only_over_its_share_of_the_budget(budget, expected):
    """compile.tiled_loss "planned": 24 tokens x 61 words x (4 + 8) bytes = 17 KiB of logits and
    loss values, over 2 % of a 100 kB budget, under 2 % of 1 GB; no budget: never tiled."""
    from deepcompile.passes.tiling_choice import PLANNED, TilingChoice

    model = _tiny_llama()
    tokens = torch.randint(0, 61, (2, 12))
    tiled = tiled_loss.TiledLoss(5, TilingChoice(PLANNED, budget))
    out = run_with_pass(model, tiled.rewrite, input_ids=tokens, labels=tokens, use_cache=False)
    assert (tiled.replaced, tiled.choice.left) == (expected, 1 - expected)
    assert bool(out.logits.isnan().all()) == bool(expected)  # untiled, the logits are real
