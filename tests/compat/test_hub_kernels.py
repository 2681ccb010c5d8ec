"""compat/hub_kernels.py: transformers (>= 5.25) wraps attention modules in the ``kernels``
package's routing forward, which Dynamo refuses inside activation checkpointing (the layer then runs
eagerly, unseen by graph passes). On a transformers Llama with checkpointing: with the wrapper the
captured graphs hold no checkpoint region; bypassed, one graph holds both layers' regions and the
loss equals eager's. A wrapper that ``kernelize`` gave a hub kernel is kept."""

from __future__ import annotations

import pytest
import torch

from deepcompile import compat

pytest.importorskip("kernels")


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not compat.kernel_routed_modules(model):
        pytest.skip("this transformers release does not wrap attention in kernels' routing")
    return model


def _checkpoint_regions(model, ids):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids, use_cache=False).loss
    finally:
        torch._dynamo.reset()
    regions = sum(1 for gm in graphs for n in gm.graph.nodes
                  if n.op == "call_function" and compat.is_higher_order_op(n.target))
    return loss.detach(), regions


def test_checkpointed_layers_reach_the_graph_once_the_routing_is_bypassed():
    model = _llama()
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = model(input_ids=ids, labels=ids, use_cache=False).loss.detach()
    _, regions_before = _checkpoint_regions(model, ids)
    assert regions_before == 0  # the routing's side effect sends both layers out of the graph
    bypassed = compat.bypass_idle_kernel_routing(model)
    assert bypassed == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert compat.kernel_routed_modules(model) == []
    loss, regions = _checkpoint_regions(model, ids)
    assert regions == 2
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)


def test_a_kernelized_wrapper_keeps_its_routing():
    model = _llama()
    attention = model.model.layers[0].self_attn
    wrapper = next(iter(attention._kernel_funcs.values()))
    wrapper.forward = type(wrapper).forward.__get__(wrapper)  # what kernelize does with a hub layer
    assert compat.bypass_idle_kernel_routing(model) == ["model.layers.1.self_attn"]
    assert compat.kernel_routed_modules(model) == ["model.layers.0.self_attn"]
