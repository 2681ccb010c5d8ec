"""compile.tiled_mlp: ``dcmlp::gated_mlp`` against the untiled MLP, and the pass on real
transformers graphs (Llama, Qwen2, Gemma's tanh GELU; with activation checkpointing). Training
parity, with and without sequence parallelism, is in
tests/sequence_parallel/test_sequence_parallel_parity.py.

Tolerances. fp32: each chunk computes the same matmuls on fewer rows, and the weight gradients
add per-chunk products instead of one product over all tokens: reordered fp32 sums, 1e-5
relative (1e-6 absolute for entries near zero). bf16: every op rounds its output to bf16 on both
sides, and the weight gradients are summed over chunks in fp32 after each chunk's product was
rounded to bf16 once: a few bf16 roundings (2**-8 relative each) of the largest entry, 2**-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _harness.captured_pass import run_with_pass
from deepcompile import ops
from deepcompile.passes import tiled_mlp, tiled_mlp_kernels

_ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _case(dtype, features=16, intermediate=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, features, generator=g).to(dtype).requires_grad_()  # 22 tokens: chunks of 5 leave 2
    gate, up = (torch.randn(intermediate, features, generator=g).div(4).to(dtype).requires_grad_() for _ in range(2))
    down = torch.randn(features, intermediate, generator=g).div(5).to(dtype).requires_grad_()
    return x, gate, up, down


@pytest.mark.parametrize("activation", sorted(_ACT))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_mlp_matches_the_untiled_mlp_and_its_gradients(dtype, activation):
    x, gate, up, down = _case(dtype)
    ref = F.linear(_ACT[activation](F.linear(x, gate)) * F.linear(x, up), down)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref_grads = torch.autograd.grad(ref, (x, gate, up, down), grad)
    got = ops.gated_mlp(x, gate, up, down, activation, 5)
    got_grads = torch.autograd.grad(got, (x, gate, up, down), grad)
    assert got.shape == ref.shape and got.dtype == dtype
    assert all(g.dtype == dtype for g in got_grads)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(got_grads, ref_grads):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    else:
        for mine, theirs in zip((got, *got_grads), (ref, *ref_grads)):
            assert (mine.float() - theirs.float()).abs().max() <= theirs.float().abs().max() * 2**-6


def test_the_backward_saves_only_the_input_and_the_weights():
    x, gate, up, down = _case(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        ops.gated_mlp(x, gate, up, down, "silu", 5).sum().backward()
    assert sorted(saved) == sorted([x.shape, gate.shape, up.shape, down.shape]), saved


def test_bad_shapes_and_activations_are_refused():
    x, gate, up, down = _case(torch.float32)
    with pytest.raises(ValueError, match="activation"):
        ops.gated_mlp(x, gate, up, down, "relu", 5)
    with pytest.raises(ValueError, match="expected"):
        ops.gated_mlp(x, gate, up, down.t(), "silu", 5)


def test_auto_chunk_keeps_one_intermediate_within_the_limit():
    for intermediate in (48, 14336, 28672):
        chunk = tiled_mlp.chunk_tokens(intermediate, 0)
        assert chunk * intermediate * 4 <= tiled_mlp.AUTO_CHUNK_BYTES < (chunk + 1) * intermediate * 4
    assert tiled_mlp.chunk_tokens(14336, 7) == 7


def _model(kind):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, attn_implementation="sdpa")
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=8, **common))  # gelu_pytorch_tanh


@pytest.mark.parametrize("kind,checkpointing", [("llama", False), ("llama", True), ("qwen2", False),
                                                ("gemma", False)])
def test_the_pass_tiles_every_transformers_mlp_and_keeps_loss_and_gradients(kind, checkpointing):
    model = _model(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = model(input_ids=tokens, labels=tokens, use_cache=False)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    tiled = tiled_mlp.TiledMLP(5)
    out = run_with_pass(model, tiled.rewrite, input_ids=tokens, labels=tokens, use_cache=False)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    assert tiled.replaced == 2  # both layers' MLPs (inside the checkpointed regions' subgraphs too)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for (name, _), mine, theirs in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)


def test_an_mlp_whose_intermediate_is_read_elsewhere_is_left_alone():
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)

    def mlp(x):
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def mlp_and_gate(x):
        pre = F.linear(x, gate)
        return F.linear(F.silu(pre) * F.linear(x, up), down), pre

    def biased(x):
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down, torch.ones(4))

    for fn, expected in ((mlp, 1), (mlp_and_gate, 0), (biased, 0)):
        counts = []

        def backend(gm, example_inputs):
            counts.append(tiled_mlp.tile_mlps(gm, 2))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(fn, backend=backend)(torch.randn(5, 4))
        assert counts == [expected], fn.__name__
    torch._dynamo.reset()


def test_every_activation_of_the_pass_has_a_kernel():
    assert set(tiled_mlp_kernels.ACTIVATIONS) == {"silu", "gelu", "gelu_tanh"}


@pytest.mark.parametrize("budget,expected", [(None, 0), (10**9, 0), (10**5, 2)])
def test_planned_tiles_only_what_exceeds_its_share_of_the_budget(budget, expected):
    """compile.tiled_mlp "planned": the tiny Llama's MLP holds 4 x 24 tokens x 48 x 4 bytes =
    18 KiB of intermediates, over 2 % of a 100 kB budget, under 2 % of 1 GB; no budget (a CPU
    device): never."""
    from deepcompile.passes.tiling_choice import PLANNED, TilingChoice

    model = _model("llama")
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    tiled = tiled_mlp.TiledMLP(5, TilingChoice(PLANNED, budget))
    run_with_pass(model, tiled.rewrite, input_ids=tokens, labels=tokens, use_cache=False)
    assert (tiled.replaced, tiled.choice.tiled, tiled.choice.left) == (expected, expected, 2 - expected)


def _engine_body(ctx, budget, expected):
    import deepcompile

    model = _model("llama")
    config = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "compile": {"tiled_mlp": "planned", "memory_budget_bytes": budget, "backend": "eager"}}
    engine = deepcompile.initialize(model, None, config)
    engine.compile(backend="eager")
    try:
        tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
        engine.backward(engine(input_ids=tokens, labels=tokens, use_cache=False).loss)  # no "found none" error
        engine.step()
        assert engine.tiled_mlp.replaced == expected, (engine.tiled_mlp.replaced, expected)
    finally:
        engine.destroy()


@pytest.mark.world_size(1)
@pytest.mark.parametrize("budget,expected", [(10**5, 2), (10**12, 0)])
def test_the_engine_plans_the_tiled_mlp_from_its_memory_budget(budget, expected):
    from _harness.multiproc import run_distributed

    run_distributed(_engine_body, 1, args=(budget, expected), timeout=300)
