"""Hugging Face weights: ``deepcompile.load_hf_weights`` and ``Engine.save_hf``.

Real transformers models (a tiny Llama, the same with tied embeddings, a tiny Qwen2-MoE whose
fused expert tensors ``save_pretrained`` stores per expert), their real ``save_pretrained`` files
in tmp_path (one file, or sharded with an index), real gloo groups of 2 and 3 ranks (under
DC_TEST_DEVICE=cuda: one rank per GPU, sizes above the GPU count skip).

* loading into an engine (ZeRO-1/2/3) of a differently seeded model gives exactly the file's
  weights, each rank reading exactly its own elements (counted on the real ``get_slice``), and
  one training step matches single-process training of ``from_pretrained``'s model;
* ``save_hf`` writes what ``AutoModelForCausalLM.from_pretrained`` loads back exactly (same
  logits), sharded with an index or as one file; a failed export leaves the earlier one intact;
  non-zero ranks never create a full-size tensor while exporting;
* files that do not fit the model (missing, misshapen, extra tensors; a bad file on one rank
  only) raise one error naming every problem on every rank, and leave the engine as it was.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import require_world_size, run_distributed, ws_id
from _harness.parity_cases import GLOBAL_BATCH, make_optimizer

# The engine trains eagerly here and in the single-process reference, in fp32: only the
# summation order of the reduced gradient differs (as in tests/parity/test_zero3_parity.py's eager cases).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
VOCAB = 61


def _config(name: str):
    from transformers import LlamaConfig, Qwen2MoeConfig

    if name.startswith("llama"):
        return LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=37, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           tie_word_embeddings=name == "llama_tied", attn_implementation="eager")
    return Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                          tie_word_embeddings=False, attn_implementation="eager")


def build(name: str, seed: int, device="cpu"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(name)).to(device)


def tokens(step: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, 8), generator=g).to(device)


def write_pretrained(name: str, folder: str, max_shard_size: str = "50GB") -> None:
    """The reference weights (seed 1234), as transformers writes them."""
    build(name, 1234).save_pretrained(folder, max_shard_size=max_shard_size)


def load_pretrained(folder: str, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).to(device)


class _CountingSlice:
    def __init__(self, inner, name, counts):
        self._inner, self._name, self._counts = inner, name, counts

    def get_shape(self):
        return self._inner.get_shape()

    def __getitem__(self, index):
        got = self._inner[index]
        self._counts[self._name] = self._counts.get(self._name, 0) + got.numel()
        return got


class _CountingFile:
    """A real ``safe_open`` handle that counts the elements each read returns, by tensor name."""

    def __init__(self, inner, counts):
        self._inner, self._counts = inner, counts

    def keys(self):
        return self._inner.keys()

    def get_slice(self, name):
        return _CountingSlice(self._inner.get_slice(name), name, self._counts)

    def get_tensor(self, name):  # the loader must never read a whole tensor behind get_slice's back
        got = self._inner.get_tensor(name)
        self._counts[name] = self._counts.get(name, 0) + got.numel()
        self._counts["<whole reads>"] = self._counts.get("<whole reads>", 0) + 1
        return got


def count_reads(counts):
    from deepcompile.checkpoint import safetensors_files

    real = safetensors_files.safe_open
    safetensors_files.safe_open = lambda path, framework: _CountingFile(real(path, framework=framework), counts)
    return lambda: setattr(safetensors_files, "safe_open", real)


def _all_ranks(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _stored_numels(folder: str):
    from deepcompile.checkpoint.safetensors_files import SafetensorsWeights

    return {name: shape.numel() for name, shape in SafetensorsWeights(folder).shapes.items()}


def _local_batch(x, ctx):
    n = GLOBAL_BATCH // ctx.world_size
    return x[ctx.rank * n:(ctx.rank + 1) * n]


# ---- load, train, export, reload ----------------------------------------------------------------


def _roundtrip_body(ctx, name, stage, load_path, folder, out_dir, export_shard_size):
    import deepcompile
    from deepcompile.checkpoint.safetensors_files import INDEX_FILE, SINGLE_FILE

    torch._dynamo.reset()
    model = build(name, seed=99 + ctx.rank, device=ctx.device)  # not the file's weights, differing per rank
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": stage}})
    reference = load_pretrained(folder, ctx.device)

    counts = {}
    restore = count_reads(counts)
    try:
        deepcompile.load_hf_weights(engine, load_path)
    finally:
        restore()

    # Each rank read exactly its own elements: no whole tensor, as many elements as its shards
    # hold, and over all ranks every stored element once.
    assert counts.get("<whole reads>", 0) == 0
    shards = list(engine.sharding.shards())
    assert sum(counts.values()) == sum(s.end - s.start for s in shards)
    totals = {}
    for theirs in _all_ranks(counts):
        for key, n in theirs.items():
            totals[key] = totals.get(key, 0) + n
    assert totals == _stored_numels(folder)

    # The engine holds the file's weights exactly (rank 0; the others get {}).
    expected = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    state = engine.full_state_dict()
    if ctx.rank == 0:
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
    else:
        assert state == {}

    # One step matches single-process training from the same weights on the whole batch.
    x = tokens(0, ctx.device)
    loss = engine(input_ids=_local_batch(x, ctx), labels=_local_batch(x, ctx)).loss
    engine.backward(loss)
    engine.step()
    opt = make_optimizer(reference.parameters())
    reference(input_ids=x, labels=x).loss.backward()
    opt.step()
    trained = engine.full_state_dict(all_ranks=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value.detach().cpu(), **FP32_TOL, msg=lambda m: f"{key}: {m}")

    # The export loads back through transformers with exactly the trained weights and logits.
    engine.save_hf(out_dir, **({"max_shard_size": export_shard_size} if export_shard_size else {}))
    probe = tokens(1, ctx.device)
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    if ctx.rank == 0:
        files = sorted(os.listdir(out_dir))
        weights = [f for f in files if f.endswith(".safetensors")]
        if export_shard_size:
            assert INDEX_FILE in files and len(weights) > 1, files
        else:
            assert weights == [SINGLE_FILE] and INDEX_FILE not in files, files
        assert "config.json" in files
        # The tensors save_pretrained writes, by name and shape: tied weights once, Qwen2-MoE's
        # fused experts split per expert.
        assert _stored_numels(out_dir) == _stored_numels(folder)
        back = load_pretrained(out_dir, ctx.device)
        assert type(back) is type(reference)
        for key, value in back.state_dict().items():
            assert torch.equal(value.detach().cpu(), trained[key]), key
        with torch.no_grad():
            # Same weights and the same kernels in one process: only nondeterministic kernels
            # (none on CPU) could tell the two apart.
            torch.testing.assert_close(back(input_ids=probe).logits, logits, rtol=1e-6, atol=1e-6)
    engine.destroy()


ROUNDTRIPS = [
    # world, model, stage, files written ("single" / save_pretrained shard size), path given, export shard size
    (2, "llama", 3, "single", "file", None),
    (2, "llama_tied", 2, "20KB", "index", "20KB"),
    (2, "qwen2_moe", 3, "100KB", "folder", "100KB"),
    (2, "qwen2_moe", 1, "single", "folder", None),
    (3, "llama", 1, "20KB", "folder", "20KB"),
    (3, "llama_tied", 3, "single", "folder", None),
    (3, "qwen2_moe", 2, "100KB", "index", "150KB"),
]


@pytest.mark.parametrize("world,name,stage,written,given,export", ROUNDTRIPS,
                         ids=[f"ws{c[0]}-{c[1]}-z{c[2]}-{c[3]}-{c[4]}" for c in ROUNDTRIPS])
def test_load_train_export_reload(tmp_path, world, name, stage, written, given, export):
    require_world_size(world)
    folder = str(tmp_path / "pretrained")
    write_pretrained(name, folder, "50GB" if written == "single" else written)
    listed = os.listdir(folder)
    assert ("model.safetensors.index.json" in listed) == (written != "single"), listed  # the case is what it says
    load_path = {"folder": folder, "file": os.path.join(folder, "model.safetensors"),
                 "index": os.path.join(folder, "model.safetensors.index.json")}[given]
    run_distributed(_roundtrip_body, world_size=world,
                    args=(name, stage, load_path, folder, str(tmp_path / "export"), export), timeout=300)


# ---- files that do not fit --------------------------------------------------------------------


def _bad_files_body(ctx, stage, good, cases, per_rank_bad):
    import deepcompile
    from deepcompile.checkpoint.hf_weights import HFWeightsError

    torch._dynamo.reset()
    model = build("llama", seed=7, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": stage}})
    before = engine.full_state_dict(all_ranks=True)
    for path, needles in cases:
        with pytest.raises(HFWeightsError) as raised:
            deepcompile.load_hf_weights(engine, path)
        message = str(raised.value)
        for needle in needles:
            assert needle in message, (needle, message)
        # Every rank raised the same message.
        assert len(set(_all_ranks(message))) == 1
    # A file bad on one rank only (rank 1 sees a misshapen tensor): every rank raises, saying where.
    path = per_rank_bad if ctx.rank == 1 else good
    with pytest.raises(HFWeightsError, match=r"model\.norm\.weight \(25,\).*seen on rank 1"):
        deepcompile.load_hf_weights(engine, path)
    # Nothing was loaded, and no rank was left inside a collective (this one is collective too).
    after = engine.full_state_dict(all_ranks=True)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Extra tensors are accepted with strict=False (with a warning); the rest loads.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deepcompile.load_hf_weights(engine, cases[2][0], strict=False)
    assert any("model.extra.weight" in str(w.message) for w in caught)
    loaded = engine.full_state_dict(all_ranks=True)
    reference = load_pretrained(good)
    assert all(torch.equal(loaded[k], v.detach().cpu()) for k, v in reference.state_dict().items())
    engine.destroy()


def _write_altered(good: str, path: str, drop=(), replace=None, add=None) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(good, "model.safetensors"))
    for key in drop:
        del tensors[key]
    tensors.update(replace or {})
    tensors.update(add or {})
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("world,stage", [(2, 3), (3, 1)], ids=["ws2-z3", "ws3-z1"])
def test_bad_files_raise_one_error_on_every_rank(tmp_path, world, stage):
    require_world_size(world)
    good = str(tmp_path / "good")
    write_pretrained("llama", good)
    missing = _write_altered(good, str(tmp_path / "missing.safetensors"), drop=["model.layers.1.mlp.down_proj.weight"])
    misshapen = _write_altered(good, str(tmp_path / "misshapen.safetensors"), replace={"model.norm.weight": torch.ones(25)})
    extra = _write_altered(good, str(tmp_path / "extra.safetensors"), add={"model.extra.weight": torch.ones(3)})
    everything = _write_altered(good, str(tmp_path / "everything.safetensors"), drop=["lm_head.weight"],
                                replace={"model.norm.weight": torch.ones(25)}, add={"model.extra.weight": torch.ones(3)})
    os.makedirs(tmp_path / "broken_index")
    with open(tmp_path / "broken_index" / "model.safetensors.index.json", "w") as f:
        f.write('{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}')
    cases = [
        (missing, ["missing from the files: model.layers.1.mlp.down_proj.weight"]),
        (misshapen, ["wrong shape: model.norm.weight (25,) (the model's is (24,))"]),
        (extra, ["not in the model (strict=False accepts them): model.extra.weight"]),
        # One error naming all three problems.
        (everything, ["missing from the files: lm_head.weight", "wrong shape: model.norm.weight",
                      "not in the model (strict=False accepts them): model.extra.weight"]),
        (str(tmp_path / "nowhere"), ["nowhere does not exist"]),
        (str(tmp_path / "broken_index"), ["lists files that do not exist: model-00001-of-00002.safetensors"]),
    ]
    run_distributed(_bad_files_body, world_size=world, args=(stage, good, cases, misshapen), timeout=300)


# ---- exports: failures keep the earlier one, memory on the other ranks ----------------------------


def _snapshot(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def _failed_export_body(ctx, good, out_dir):
    import deepcompile
    from deepcompile.checkpoint import safetensors_files
    from deepcompile.checkpoint.hf_weights import HFWeightsError

    torch._dynamo.reset()
    model = build("llama", seed=3, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": 3}})
    deepcompile.load_hf_weights(engine, good)
    engine.save_hf(out_dir, max_shard_size="20KB")
    if ctx.rank == 0:
        with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
            f.write("{}")
    earlier = _snapshot(out_dir) if ctx.rank == 0 else None
    assert earlier is None or len([n for n in earlier if n.endswith(".safetensors")]) > 1

    x = tokens(0, ctx.device)
    engine.backward(engine(input_ids=_local_batch(x, ctx), labels=_local_batch(x, ctx)).loss)
    engine.step()

    # Rank 0 fails at its third tensor: every rank raises; the earlier export is untouched.
    real_add = safetensors_files.ShardedWriter.add
    calls = []

    def failing_add(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real_add(self, name, tensor)

    safetensors_files.ShardedWriter.add = failing_add
    try:
        with pytest.raises(HFWeightsError, match=r"disk full \(simulated\).*seen on rank 0"):
            engine.save_hf(out_dir, max_shard_size="20KB")
    finally:
        safetensors_files.ShardedWriter.add = real_add
    parent = os.path.dirname(out_dir)
    if ctx.rank == 0:
        assert _snapshot(out_dir) == earlier
        assert sorted(os.listdir(parent)) == [os.path.basename(out_dir), "good"], "a staging folder was left behind"

    # A successful export as one file replaces the sharded one; files that are not weights stay.
    engine.save_hf(out_dir)
    trained = engine.full_state_dict()
    if ctx.rank == 0:
        files = sorted(os.listdir(out_dir))
        assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"], files
        assert sorted(os.listdir(parent)) == [os.path.basename(out_dir), "good"]
        back = load_pretrained(out_dir)
        assert all(torch.equal(v.detach(), trained[k]) for k, v in back.state_dict().items())
        assert not all(torch.equal(v.detach(), load_pretrained(good).state_dict()[k]) for k, v in back.state_dict().items())
    engine.destroy()


@pytest.mark.world_size(2)
def test_failed_export_keeps_the_earlier_one(tmp_path):
    require_world_size(2)
    good = str(tmp_path / "good")
    write_pretrained("llama", good)
    run_distributed(_failed_export_body, world_size=2, args=(good, str(tmp_path / "export")), timeout=300)


def _export_memory_body(ctx, good, out_dir):
    from torch.overrides import TorchFunctionMode

    import deepcompile

    class LargestTensor(TorchFunctionMode):
        """The largest tensor any torch function or tensor method returns while active."""

        largest = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    torch._dynamo.reset()
    model = build("qwen2_moe", seed=5, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), {"zero_optimization": {"stage": 3}})
    deepcompile.load_hf_weights(engine, good)
    shards = list(engine.sharding.shards())
    biggest_param = max(s.numel for s in shards)
    biggest_piece = max(-(-s.numel // ctx.world_size) for s in shards)
    for export in (lambda: engine.save_hf(out_dir, max_shard_size="100KB"), engine.full_state_dict):
        recorder = LargestTensor()
        with recorder:
            export()
        if ctx.rank == 0:
            assert recorder.largest >= biggest_param  # the recorder sees the gathered parameters
        else:
            assert recorder.largest <= biggest_piece < biggest_param, (recorder.largest, biggest_piece)
    engine.destroy()


@pytest.mark.parametrize("world", [2, 3], ids=ws_id)
def test_export_never_creates_a_full_parameter_off_rank_zero(tmp_path, world):
    require_world_size(world)
    good = str(tmp_path / "good")
    write_pretrained("qwen2_moe", good)
    run_distributed(_export_memory_body, world_size=world, args=(good, str(tmp_path / "export")), timeout=300)


# ---- plain modules, one process -----------------------------------------------------------------


@pytest.mark.parametrize("name,written", [("llama_tied", "single"), ("qwen2_moe", "100KB")])
def test_load_into_a_plain_module(tmp_path, name, written):
    import deepcompile

    folder = str(tmp_path / "pretrained")
    write_pretrained(name, folder, "50GB" if written == "single" else written)
    model = build(name, seed=42)
    if name == "llama_tied":
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in f.keys()  # what the tied case is about
    deepcompile.load_hf_weights(model, folder)
    expected = load_pretrained(folder).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    if name == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_plain_module_missing_expert_names_the_stored_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    import deepcompile
    from deepcompile.checkpoint.hf_weights import HFWeightsError

    folder = str(tmp_path / "pretrained")
    write_pretrained("qwen2_moe", folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    tensors["model.layers.1.mlp.experts.3.down_proj.weight"] = torch.ones(64, 31)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    model = build("qwen2_moe", seed=42)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HFWeightsError) as raised:
        deepcompile.load_hf_weights(model, folder)
    message = str(raised.value)
    assert "missing from the files: model.layers.0.mlp.experts.gate_up_proj" in message
    assert "absent: model.layers.0.mlp.experts.2.up_proj.weight" in message
    assert "wrong shape: model.layers.1.mlp.experts.down_proj: the stacked tensors differ in shape" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---- pieces -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (5, 1), (2, 1, 3)])
def test_flat_range_blocks_cover_exactly_the_range(shape):
    from deepcompile.checkpoint.safetensors_files import flat_range_blocks

    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    n = full.numel()
    for start in range(n + 1):
        for end in range(start, n + 1):
            blocks = flat_range_blocks(shape, start, end)
            got = torch.cat([full[b].reshape(-1) for b in blocks]) if blocks else full.reshape(-1)[:0]
            assert torch.equal(got, full.reshape(-1)[start:end]), (start, end, blocks)
            assert len(blocks) <= max(1, 2 * len(shape) - 1)


def test_max_shard_size_parsing():
    from deepcompile.checkpoint.safetensors_files import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(1234) == 1234
    for bad in ("5 parsecs", "-1GB", 0, "", None, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
