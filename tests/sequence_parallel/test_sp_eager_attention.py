"""Under sequence parallelism every attention call is the rewritten one, or the forward refuses
(sequence_parallel/eager_guard.py).

The engine used to check only that the pass rewrote some call over the whole model: one decoder
layer under ``torch.compiler.disable`` (its attention then runs eagerly over this rank's slice)
trained with a loss off by 2.4e-4 relative and no error. Now, on two gloo ranks, that forward
raises on every rank, naming the cause; with the layer compiled again the same engine trains and
its loss equals one process's (the parity suite's tolerance, fp32 1e-5). Outside the engine's
forward (evaluation of the whole model, here after ``destroy``) attention runs as usual, and the
wrapper is gone once no sequence-parallel engine is left.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _harness.multiproc import run_distributed


def _body(ctx):
    import deepcompile
    from deepcompile.sequence_parallel import SequenceParallelError
    from test_sequence_parallel_parity import tiny_llama_sdpa

    from _harness.parity_cases import make_optimizer

    original = F.scaled_dot_product_attention
    torch._dynamo.reset()
    model = tiny_llama_sdpa()
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), "sgd_momentum"),
                                    {"zero_optimization": {"stage": 2}, "sequence_parallel_size": 2})
    engine.compile(backend="eager")
    layer = model.model.layers[1]
    compiled_forward = layer.forward
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    try:
        local = engine.sequence_parallel.shard({"input_ids": ids, "labels": ids})
        layer.forward = torch.compiler.disable(compiled_forward)
        with pytest.raises(SequenceParallelError, match="ran outside the compiled graphs"):
            engine(**local, use_cache=False)
        torch._dynamo.reset()
        layer.forward = compiled_forward
        out = engine(**local, use_cache=False)
        loss = engine.sequence_parallel.loss(out.loss, local["shift_labels"])
        engine.backward(loss)
        engine.step()
    finally:
        engine.destroy()
    assert F.scaled_dot_product_attention is original  # no sequence-parallel engine left
    with torch.no_grad():
        reference = tiny_llama_sdpa()(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.world_size(2)
def test_an_attention_call_outside_the_graphs_is_refused():
    run_distributed(_body, 2, timeout=300)
