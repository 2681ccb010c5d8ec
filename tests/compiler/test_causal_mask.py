"""The causal-mask elision (passes/causal_mask.py): transformers' whole-model graphs materialise a
``[B, 1, S, S]`` mask under tracing; where it cannot depend on the data the pass replaces it with
``is_causal=True``.

On transformers' Llama, Qwen2 and Gemma graphs (with and without activation checkpointing): every
attention call loses its mask, and the loss and gradients equal the eager model's (which itself
passes no mask). Left alone: a padding ``attention_mask`` and packed ``position_ids`` (the mask then
depends on the data: padded and packed batches must keep it, and the results equal eager's with
them), models whose configuration asks for sliding windows, and encoders (bidirectional). Broken on purpose: eliding a
padding mask changes the loss. Through the engine (ZeRO-3, one rank): the pass runs and the
losses equal one process.

Tolerance: fp32 1e-5: the same attention with the mask expressed as ``is_causal`` (SDPA's math and
flash paths sum in different orders).
"""

from __future__ import annotations

import pytest
import torch

from _harness.captured_pass import run_with_pass
from _harness.multiproc import run_distributed

from deepcompile.passes.causal_mask import elide_causal_masks, masks_are_causal

S = 12
TOL = dict(rtol=1e-5, atol=1e-5)


def _model(kind: str, checkpointing: bool = False):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa")
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
    elif kind == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=8))
    else:
        raise ValueError(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _elided(gm):
    elided, packed = elide_causal_masks(gm)
    assert packed == 0  # no documents key: nothing is made packed
    return elided


def _loss_and_grads(model, out):
    loss = out.loss
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    return loss.detach(), grads


def _run(model, rewrite, **inputs):
    counted = []

    def counting(gm):
        counted.append(rewrite(gm))

    out = run_with_pass(model, counting, use_cache=False, **inputs)
    return _loss_and_grads(model, out), sum(counted)


def _assert_same(got, ref):
    torch.testing.assert_close(got[0], ref[0], **TOL)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma"])
def test_masks_of_unpadded_batches_become_is_causal(kind, checkpointing):
    model = _model(kind, checkpointing)
    assert masks_are_causal(model)
    ids = torch.randint(0, 40, (2, S), generator=torch.Generator().manual_seed(1))
    model.train()
    ref = _loss_and_grads(model, model(input_ids=ids, labels=ids, use_cache=False))
    got, elided = _run(model, _elided, input_ids=ids, labels=ids)
    assert elided == 2  # both layers' attention
    _assert_same(got, ref)


def _padded_and_packed_inputs():
    ids = torch.randint(0, 40, (2, S), generator=torch.Generator().manual_seed(2))
    padding = torch.ones(2, S, dtype=torch.long)
    padding[1, :4] = 0  # left padding: without the mask, real tokens would attend to it
    packed = torch.cat([torch.arange(5), torch.arange(S - 5)]).expand(2, S)
    labels = ids.masked_fill(padding == 0, -100)
    return {"padded": dict(input_ids=ids, labels=labels, attention_mask=padding),
            "packed": dict(input_ids=ids, labels=ids, position_ids=packed)}


@pytest.mark.parametrize("case", ["padded", "packed"])
def test_masks_that_depend_on_the_batch_are_kept(case):
    model = _model("llama", checkpointing=True)
    inputs = _padded_and_packed_inputs()[case]
    model.train()
    ref = _loss_and_grads(model, model(**inputs, use_cache=False))
    got, elided = _run(model, _elided, **inputs)
    assert elided == 0
    _assert_same(got, ref)


def test_eliding_a_padding_mask_is_seen():
    """Broken on purpose: the pass with its data check removed drops the padding mask too."""
    from deepcompile.passes import causal_mask

    model = _model("llama")
    inputs = _padded_and_packed_inputs()["padded"]
    ref = _loss_and_grads(model, model(**inputs, use_cache=False))
    original = causal_mask._data_independent
    causal_mask._data_independent = lambda node: True
    try:
        got, elided = _run(model, _elided, **inputs)
    finally:
        causal_mask._data_independent = original
    assert elided == 2
    with pytest.raises(AssertionError):
        _assert_same(got, ref)


def test_sliding_window_and_encoder_models_are_not_causal():
    import transformers

    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4))
    assert not masks_are_causal(mistral)
    assert not masks_are_causal(torch.nn.Linear(2, 2))  # nothing says what its mask is
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=4, intermediate_size=48))
    assert not masks_are_causal(bert)  # bidirectional: an all-true traced mask must stay


def _engine_body(ctx):
    import deepcompile

    ids = torch.randint(0, 40, (2, S), generator=torch.Generator().manual_seed(3))
    reference = _model("llama", checkpointing=True)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for _ in range(2):
        loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    torch._dynamo.reset()
    model = _model("llama", checkpointing=True)
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    {"zero_optimization": {"stage": 3}})
    engine.compile(backend="eager")
    try:
        losses = []
        on_device = ids.to(ctx.device)  # the reference ran on the CPU; the engine on the test's device
        for _ in range(2):
            loss = engine(input_ids=on_device, labels=on_device, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert engine.causal_masks is not None and engine.causal_masks.elided == 2, engine.causal_masks
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    finally:
        engine.destroy()
    # compile.packed_sequences on a model whose attention is not plain causal: refused, not ignored
    import transformers

    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4))
    with pytest.raises(ValueError, match="packed_sequences: the model's attention is not plain causal"):
        deepcompile.initialize(mistral, torch.optim.SGD(mistral.parameters(), lr=0.1),
                               {"zero_optimization": {"stage": 3}, "compile": {"packed_sequences": True}})


@pytest.mark.world_size(1)
def test_engine_runs_the_pass_and_matches_one_process():
    run_distributed(_engine_body, world_size=1, timeout=300)


def test_models_whose_attention_modules_disagree_keep_their_masks():
    """Encoder-decoders (an encoder's attention is bidirectional) and a decoder with one
    bidirectional layer: the pass would give their all-true or padding-free masks is_causal."""
    import transformers

    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=40, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4))
    assert not masks_are_causal(bart)
    assert not masks_are_causal(t5)
    llama = _model("llama")
    assert masks_are_causal(llama)
    llama.model.layers[1].self_attn.is_causal = False  # one bidirectional layer
    assert not masks_are_causal(llama)


def _attend(q, k, v):
    lq, lk = q.shape[-2], k.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)  # shapes only: data-independent
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("query_length,expected", [(8, 1), (3, 0)], ids=["self", "kv_cache"])
def test_a_call_whose_query_and_key_lengths_differ_keeps_its_mask(query_length, expected):
    """A KV cache (or cross-attention) attends from fewer tokens than it attends to; its mask is
    not the plain causal one is_causal gives, even when it follows from shapes alone."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, query_length, 4, generator=g)
    k, v = torch.randn(1, 2, 8, 4, generator=g), torch.randn(1, 2, 8, 4, generator=g)
    counted = []

    def backend(gm, example_inputs):
        counted.append(elide_causal_masks(gm)[0])
        return gm.forward

    torch._dynamo.reset()
    try:
        got = torch.compile(_attend, backend=backend)(q, k, v)
    finally:
        torch._dynamo.reset()
    assert sum(counted) == expected
    torch.testing.assert_close(got, _attend(q, k, v), **TOL)
