"""Sharded initialisation (issue 17, item 1): ``deepcompile.initialize`` on a model built on the
``meta`` device or on the CPU, each rank materialising only what it keeps.

* values: a meta-built Llama initialised by ``init_fn`` (transformers' ``_init_weights``) from
  differently seeded ranks equals, exactly, a CPU-built Llama re-initialised by the same function
  from rank 0's seed in one process (tied embeddings included), and trains like it (ZeRO-1/2/3);
* without ``init_fn``: rank 0's values (differently seeded CPU models, or rank 0 real and the other
  ranks on meta); a meta model refuses its first forward, naming what has no value, until a
  loader writes every shard and calls ``sync_params_from_shards()``, then trains like the
  reference;
* bad ``init_fn`` (leaves a parameter or buffer unset): an error naming them, on every rank;
* memory: peak host bytes allocated during ``initialize`` of a many-layer model at world sizes 2
  and 3 stay within ``2 * (N / W + largest parameter)`` elements' bytes, which is below the size
  of the model (so no rank ever held it whole); on a GPU the same bound with the CUDA allocator's
  peak.

How host memory is counted (:func:`peak_cpu_bytes`): torch's profiler with ``profile_memory``
receives every allocation and free of c10's CPU allocator (the one every CPU tensor's storage
comes from), with its exact size; each event's *self* bytes (its own allocations less its frees,
children excluded, so nothing is counted twice) is summed in time order and the running maximum is
the peak. Frees of tensors allocated before profiling started are not reported, so the count can
only over-estimate. Process-wide measures (tracemalloc, RSS) see Python objects and allocator
caching instead of tensors.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import run_distributed, single_world_size, world_sizes, ws_id
from _harness.parity_cases import (RunResult, TiedEmbeddingLM, assert_parity, batch, global_grad_norm, make_optimizer,
                                   run_steps, tiny_llama, train_reference)
from test_zero3_parity import FP32_TOL

WORLD = single_world_size()
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
SEED = 100  # rank 0's seed; rank r seeds SEED + r, so only a broadcast of rank 0's state agrees


class LlamaLoss(nn.Module):
    def __init__(self, tie=False):
        super().__init__()
        self.model = tiny_llama()
        if tie:
            self.model.config.tie_word_embeddings = True
            self.model.lm_head.weight = self.model.model.embed_tokens.weight

    def forward(self, tokens, targets):
        return self.model(input_ids=tokens, labels=targets).loss


def hf_init(model):
    """transformers' own initialisation of one module (its direct parameters and buffers), as an
    ``init_fn``: the ``_init_weights`` of the Llama inside ``model`` (it reads only the config)."""
    return model.model._init_weights


def reset_init(module):
    """torch's own initialisation (Linear, Embedding)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.reset_parameters()


def reference_init(build, init_fn, device):
    """What the engine must reproduce: a CPU-built model, re-initialised in one process by
    ``for m in model.modules(): init_fn(m)`` on ``device`` from rank 0's seed (``init_fn`` None:
    the model's own ``hf_init``)."""
    torch.manual_seed(1)
    model = build().to(device)
    init_fn = init_fn or hf_init(model)
    torch.manual_seed(SEED)
    with torch.no_grad():
        for m in model.modules():
            init_fn(m)
    return model


def train(engine, name, steps, device):
    return run_steps(engine, name, steps, device)


def train_single(model, name, steps, device):
    opt = make_optimizer(list(model.parameters()))
    losses, norms = [], []
    for step in range(steps):
        loss = model(*batch(name, step, device=device))
        loss.backward()
        losses.append(loss.item())
        norms.append(global_grad_norm(model.parameters()))
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().float().cpu() for k, v in model.named_parameters(remove_duplicate=False)}
    return RunResult(losses, params, norms)


def zero_config(stage):
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 10}}


# ---- values ------------------------------------------------------------------------------------


def _meta_init_body(ctx, stage, tie, backend):
    import deepcompile

    torch._dynamo.reset()
    torch.manual_seed(SEED + ctx.rank)
    with torch.device("meta"):
        model = LlamaLoss(tie=tie)
    assert all(p.is_meta for p in model.parameters())
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), zero_config(stage),
                                    init_fn=hf_init(model), device=ctx.device)
    assert torch.initial_seed() == SEED + ctx.rank  # each rank's own generator is left alone
    ref = reference_init(lambda: LlamaLoss(tie=tie), None, ctx.device)
    got = engine.full_state_dict(all_ranks=True)
    want = ref.state_dict()
    assert set(got) == set(want)
    for key in want:  # the same kernels from the same generator state: bit-identical
        assert torch.equal(got[key], want[key].cpu()), key
    if tie:
        assert engine.sharding.param_names() == {i: n for i, n in enumerate(
            dict(ref.named_parameters()).keys())}, "a tied parameter must be sharded once"
    if backend is not None:
        engine.compile(backend=backend)
    result = train(engine, "llama", 3, ctx.device)
    assert_parity(result, train_single(ref, "llama", 3, ctx.device), **FP32_TOL)
    engine.destroy()


@pytest.mark.parametrize("stage,tie,backend", [(3, False, "eager"), (3, True, None), (2, False, None),
                                                (1, True, None)])
def test_meta_llama_with_init_fn_equals_cpu_built_model_and_trains_like_it(stage, tie, backend):
    run_distributed(_meta_init_body, WORLD, args=(stage, tie, backend), timeout=300)


def _tied_reset_body(ctx):
    import deepcompile

    torch.manual_seed(SEED + ctx.rank)
    with torch.device("meta"):
        model = TiedEmbeddingLM()
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), zero_config(3), init_fn=reset_init,
                                    device=ctx.device)
    ref = reference_init(TiedEmbeddingLM, reset_init, ctx.device)
    got = engine.full_state_dict(all_ranks=True)
    # The shared weight was initialised by both owners, the head last (Linear's init), as in the loop.
    for key, value in ref.state_dict().items():
        assert torch.equal(got[key], value.cpu()), key
    engine.destroy()


def test_tied_parameter_stays_whole_until_its_last_owner_is_initialised():
    run_distributed(_tied_reset_body, WORLD)


def _rank0_values_body(ctx, stage, others_on_meta):
    import deepcompile

    torch.manual_seed(SEED + ctx.rank)
    if ctx.rank != 0 and others_on_meta:
        with torch.device("meta"):
            model = LlamaLoss()
    else:
        model = LlamaLoss()
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), zero_config(stage), device=ctx.device)
    torch.manual_seed(SEED)
    want = LlamaLoss().state_dict()
    got = engine.full_state_dict(all_ranks=True)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    engine.destroy()


@pytest.mark.parametrize("stage", [3, 1])
@pytest.mark.parametrize("others_on_meta", [False, True], ids=["seeded_differently", "others_on_meta"])
def test_without_init_fn_every_rank_gets_rank0_values(stage, others_on_meta):
    run_distributed(_rank0_values_body, WORLD, args=(stage, others_on_meta))


# ---- no values: the first forward refuses until weights are loaded -----------------------------


def _load_body(ctx, stage):
    import deepcompile

    torch._dynamo.reset()
    with torch.device("meta"):
        model = LlamaLoss()
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), zero_config(stage), device=ctx.device)
    tokens, targets = batch("llama", 0, device=ctx.device)
    assert len(engine.sharding.unset_params) == len(list(model.parameters()))
    with pytest.raises(RuntimeError, match=r"parameters .*model\.model\.embed_tokens\.weight.* have no values"):
        engine(tokens, targets)

    # A loader: the reference's values written through Sharding.shards() (ranges in flat
    # full-parameter coordinates), then sync_params_from_shards(). First only half of them.
    reference = dict(train_reference("llama", 0, device=ctx.device).params)
    shards = list(engine.sharding.shards())
    skipped = {s.name for s in shards[::2]}
    for s in shards:
        if s.name not in skipped:
            s.local.copy_(reference[s.name].reshape(-1)[s.start:s.end])
    engine.sharding.sync_params_from_shards()
    assert sorted(engine.sharding.unset_params) == sorted(skipped)
    with pytest.raises(RuntimeError, match="have no values") as e:
        engine(tokens, targets)
    assert sorted(skipped)[0] in str(e.value)
    for s in shards:
        s.local.copy_(reference[s.name].reshape(-1)[s.start:s.end])
    engine.sharding.sync_params_from_shards()
    assert list(engine.sharding.unset_params) == []

    # Parameters are loaded; the rotary buffers (not in any checkpoint) are still unknown.
    with pytest.raises(RuntimeError, match=r"buffers .*rotary_emb\.inv_freq.* have no values"):
        engine(tokens, targets)
    rotary = engine.module.model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)

    result = train(engine, "llama", 3, ctx.device)
    assert_parity(result, train_reference("llama", 3, device=ctx.device), **FP32_TOL)
    engine.destroy()


@pytest.mark.parametrize("stage", [3, 2])
def test_meta_model_without_init_fn_refuses_to_run_until_every_shard_is_loaded(stage):
    run_distributed(_load_body, WORLD, args=(stage,), timeout=300)


def _bad_init_body(ctx, stage):
    import deepcompile

    with torch.device("meta"):
        model = LlamaLoss()
    # Linear and Embedding only: norms' weights and the rotary buffers are left unset.
    with pytest.raises(ValueError, match="init_fn did not initialise") as e:
        deepcompile.initialize(model, make_optimizer(model.parameters()), zero_config(stage), init_fn=reset_init,
                               device=ctx.device)
    message = str(e.value)
    assert "parameter model.model.norm.weight" in message
    assert "buffer model.model.rotary_emb.inv_freq" in message
    assert "q_proj" not in message and "embed_tokens" not in message

    with torch.device("meta"):
        model = LlamaLoss()

    init = hf_init(model)

    def replaces(module):
        init(module)
        if isinstance(module, nn.Embedding):
            module.weight = nn.Parameter(torch.zeros_like(module.weight))

    with pytest.raises(ValueError, match="init_fn replaced parameter model.model.embed_tokens.weight"):
        deepcompile.initialize(model, make_optimizer(model.parameters()), zero_config(stage), init_fn=replaces,
                               device=ctx.device)


@pytest.mark.parametrize("stage", [3, 1])
def test_init_fn_that_leaves_tensors_unset_is_refused_on_every_rank(stage):
    run_distributed(_bad_init_body, WORLD, args=(stage,))


# ---- memory ------------------------------------------------------------------------------------


class Deep(nn.Module):
    """Many equal layers: the largest parameter is a small part of the model."""

    def __init__(self, width, depth):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def peak_cpu_bytes(fn):
    """(result of fn(), peak bytes of CPU tensor storage allocated while it ran): module docstring."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "block allocated before profiling started": see above
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return result, peak


def _memory_body(ctx, source, width, depth):
    import deepcompile

    torch._dynamo.reset()
    if source == "meta":
        with torch.device("meta"):
            model = Deep(width, depth)
    else:
        model = Deep(width, depth)
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    world = ctx.world_size
    # Shards (N / W fp32 elements, padding included) + one module's full parameters (fp32: 4
    # bytes per element) and its "still NaN?" check (1 byte per element) or the broadcast's and
    # the cut's transients: at most 2 * 4 bytes per element of the largest module (here one
    # weight plus its bias, ~1.01 largest), plus 64 KiB for small tensors (random generator
    # state, per-parameter flags, placeholders). The bound must be below the whole model's
    # size, or it would not show that no rank held the model.
    bound = 4 * (n / world + world) + 2 * 4 * 1.02 * largest + 64 * 1024
    if world > 1:
        assert bound < 4 * n, (bound, n)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": width * width}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # state is created at the first step
    init_fn = reset_init if source == "meta" else None
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    engine, host_peak = peak_cpu_bytes(lambda: deepcompile.initialize(model, optimizer, config, init_fn=init_fn,
                                                                      device=ctx.device))
    if ctx.device.type == "cuda":
        device_peak = torch.cuda.max_memory_allocated() - before
        # The caching allocator rounds every tensor up to 512 bytes; per parameter a shard, a
        # placeholder and a check flag live on: 3 blocks of slack each.
        assert device_peak <= bound + 3 * 512 * len(list(model.parameters())), (device_peak, bound, n)
        # Nothing of the model passes through the host: less than a quarter of one layer's weight
        # (the random generator states, flags and the runtime's setup are a few KiB).
        assert host_peak <= 1024 * 1024, host_peak
    else:
        print(f"peak host bytes {host_peak}, bound {bound:.0f}, model {4 * n}, world {world}")
        assert host_peak <= bound, (host_peak, bound, n, world)
        # Shards alone are N / W elements: the count sees them (it is not vacuous).
        assert host_peak >= 4 * n / world, (host_peak, n)
    # The shards are right: the engine's model equals the reference initialised the same way.
    x = torch.randn(4, width, device=ctx.device)
    loss = engine(x)
    assert torch.isfinite(loss)
    engine.backward(loss)
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("world", world_sizes((2, 3)), ids=ws_id)
@pytest.mark.parametrize("source", ["meta", "cpu"])
def test_initialize_peak_host_memory_is_shards_plus_one_parameter(world, source):
    # 24 layers of 96x96: N = 223k elements, largest 9.2k; bound (W=2) 0.54 of the model, (W=3) 0.37.
    run_distributed(_memory_body, world, args=(source, 96, 24), timeout=300)


@pytest.mark.gpu
def test_initialize_peak_device_memory_is_shards_plus_one_parameter():
    # 16 layers of 1024x1024 fp32 (4 MiB each): allocator rounding is negligible.
    run_distributed(_memory_body, single_world_size(), args=("meta", 1024, 16), timeout=300)
