"""Ulysses sequence parallelism, piece by piece, in one process on the CPU (the distributed
parity suite, test_sequence_parallel_parity.py, checks the whole against one process).

* ``shard_batch``: labels shifted over the whole sequence before slicing, global positions,
  padding of a length that does not divide, refusals;
* ``split_attention`` on graphs Dynamo captured (the pass reads ``example_value``): the
  all-to-alls around each SDPA call, key/value heads repeated when they do not divide, refusals
  that leave the graph alone, the slice-local mask replaced by ``is_causal``;
* config: ``sequence_parallel_size`` must divide the world and needs compilation; batch sizes
  count ``world / sp`` replicas;
* ``dcsp::all_to_all``: fake kernel shapes (and its adjoint's), the real kernel's unknown key;
* ``SequenceParallel``: off (size 1) is a no-op; on, the bookkeeping that needs no process group;
* ``global_token_mean``: the arithmetic, with the gather replaced by a stack of made-up ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import deepcompile.sequence_parallel as sp_pkg
from deepcompile import ops
from deepcompile.config import Config, ConfigError
from deepcompile.sequence_parallel import (
    SequenceParallel,
    SequenceParallelError,
    SequenceParallelGroups,
    shard_batch,
    shift_labels,
)
from deepcompile.sequence_parallel import all_to_all as a2a_mod
from deepcompile.sequence_parallel import loss as loss_mod
from deepcompile.sequence_parallel.attention import split_attention

IGNORE = -100
Z3 = {"zero_optimization": {"stage": 3}}


# ------------------------------------------------------------------------------------ helpers


def capture_graph(fn, *inputs):
    """The one graph Dynamo captures of ``fn(*inputs)`` (nodes carry ``example_value``)."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def sdpa_nodes(gm):
    targets = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def arg(node, name, default=None):
    i = _NAMES.index(name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def snapshot(gm):
    return len(gm.graph.nodes), gm.code


def qkv(heads, kv_heads, b=1, s=8, d=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, heads, s, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g),
            torch.randn(b, kv_heads, s, d, generator=g))


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2


def attend_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) + 1


def with_meta(fn, shapes):
    """A symbolic_trace graph of ``fn`` whose placeholders carry made-up example values (shapes
    SDPA itself would refuse, to reach the pass's own checks)."""
    gm = torch.fx.symbolic_trace(fn)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, shape in zip(placeholders, shapes):
        node.meta["example_value"] = torch.empty(shape, device="meta")
    return gm


# ------------------------------------------------------------------------------------ shard_batch


def test_shift_labels_moves_labels_left_over_the_whole_sequence():
    labels = torch.tensor([[1, 2, 3, 4]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, IGNORE]]


def test_shard_batch_shifts_before_slicing_and_numbers_globally():
    ids = torch.arange(16).reshape(2, 8) + 10
    batch = {"input_ids": ids, "labels": ids.clone()}
    s0, s1 = shard_batch(batch, 0, 2), shard_batch(batch, 1, 2)
    assert torch.equal(s0["input_ids"], ids[:, :4]) and torch.equal(s1["input_ids"], ids[:, 4:])
    # The last token of slice 0 predicts the first token of slice 1.
    assert torch.equal(s0["shift_labels"][:, -1], s1["input_ids"][:, 0])
    assert torch.equal(s0["shift_labels"], ids[:, 1:5])
    assert torch.equal(s1["shift_labels"], torch.cat([ids[:, 5:], torch.full((2, 1), IGNORE)], dim=1))
    for s in (s0, s1):
        assert s["labels"] is s["shift_labels"]
    assert s0["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert s1["position_ids"].tolist() == [[4, 5, 6, 7]] * 2
    # The caller's batch is left as it was.
    assert set(batch) == {"input_ids", "labels"} and torch.equal(batch["labels"], ids)


def test_shard_batch_without_labels_has_no_labels():
    out = shard_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, 1, 2)
    assert "labels" not in out and "shift_labels" not in out
    assert out["position_ids"].tolist() == [[2, 3]]


def test_shard_batch_pads_a_length_that_does_not_divide():
    ids = torch.arange(14).reshape(2, 7) + 1
    batch = {"input_ids": ids, "labels": ids}
    parts = [shard_batch(batch, r, 4, pad_token_id=99) for r in range(4)]
    for p in parts:
        assert p["input_ids"].shape == (2, 2)
    last = parts[-1]
    assert last["input_ids"][:, 1].tolist() == [99, 99]
    assert last["shift_labels"].tolist() == [[IGNORE, IGNORE]] * 2  # last real token and the pad
    assert last["position_ids"].tolist() == [[6, 7]] * 2  # the pad continues the positions
    whole = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "shift_labels", "position_ids")}
    assert torch.equal(whole["input_ids"], torch.cat([ids, torch.full((2, 1), 99)], dim=1))
    assert torch.equal(whole["shift_labels"], torch.cat([shift_labels(ids), torch.full((2, 1), IGNORE)], dim=1))
    assert torch.equal(whole["position_ids"], torch.arange(8).expand(2, 8))


def test_shard_batch_pads_inputs_embeds_with_zeros():
    embeds = torch.ones(1, 3, 5)
    parts = [shard_batch({"inputs_embeds": embeds}, r, 2) for r in range(2)]
    assert [p["inputs_embeds"].shape for p in parts] == [(1, 2, 5), (1, 2, 5)]
    assert torch.equal(parts[1]["inputs_embeds"][0, 1], torch.zeros(5))
    assert torch.equal(parts[1]["inputs_embeds"][0, 0], torch.ones(5))


def test_shard_batch_keeps_given_positions_and_continues_them_into_the_padding():
    """Given position_ids that start at an offset: slices keep them, and the padding continues
    them (check_inputs requires each slice's positions to be consecutive)."""
    ids = torch.arange(7).reshape(1, 7)
    positions = torch.arange(5, 12).reshape(1, 7)
    parts = [shard_batch({"input_ids": ids, "position_ids": positions}, r, 4) for r in range(4)]
    whole = torch.cat([p["position_ids"] for p in parts], dim=1)
    assert whole[:, :7].tolist() == positions.tolist()
    assert whole.tolist() == [list(range(5, 13))]


def test_shard_batch_mask_refused_with_padding_dropped_when_all_ones():
    ids = torch.arange(8).reshape(1, 8)
    mask = torch.ones(1, 8, dtype=torch.long)
    out = shard_batch({"input_ids": ids, "attention_mask": mask}, 0, 2)
    assert "attention_mask" not in out
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        shard_batch({"input_ids": ids, "attention_mask": mask}, 0, 2)


@pytest.mark.parametrize("rank, size", [(-1, 2), (2, 2), (0, 0), (3, 2)])
def test_shard_batch_refuses_bad_rank_or_size(rank, size):
    with pytest.raises(ValueError, match="rank"):
        shard_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, rank, size)


def test_shard_batch_needs_tokens():
    with pytest.raises(ValueError, match="input_ids"):
        shard_batch({"labels": torch.zeros(1, 4, dtype=torch.long)}, 0, 2)
    with pytest.raises(ValueError, match="input_ids"):
        shard_batch({"input_ids": torch.zeros(4, dtype=torch.long)}, 0, 2)


# ------------------------------------------------------------------------------------ split_attention


def test_split_attention_wraps_each_call_in_all_to_alls():
    def two_calls(q, k, v):
        return attend(q, k, v) + F.scaled_dot_product_attention(k, k, v)

    q, k, v = qkv(4, 4)
    gm = capture_graph(two_calls, q, k, v)
    before = sdpa_nodes(gm)
    assert len(before) == 2
    assert split_attention(gm, 2, 77) == 2
    a2a = calls(gm, ops.ALL_TO_ALL)
    assert len(a2a) == 8
    assert all(n.args[3:] == (2, 77) for n in a2a)
    for node in sdpa_nodes(gm):
        for name in ("query", "key", "value"):
            moved = arg(node, name)
            assert moved.target is ops.ALL_TO_ALL and moved.args[1:3] == (1, 2)
            # sequence gathered, heads scattered: [1, 4, 8, 16] -> [1, 2, 16, 16]
            assert tuple(moved.meta["example_value"].shape) == (1, 2, 16, 16)
        users = list(node.users)
        assert len(users) == 1 and users[0].target is ops.ALL_TO_ALL and users[0].args[1:3] == (2, 1)
        back = users[0]
        assert all(u.target is not ops.ALL_TO_ALL for u in back.users)  # the model reads the back-moved output
        assert tuple(node.meta["example_value"].shape) == (1, 2, 16, 16)
    # The rewritten graph still computes [B, H, S / P, D] from [B, H, S / P, D] (fake kernel).
    with FakeTensorMode():
        out = gm(*(torch.empty(t.shape) for t in (q, k, v)))
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert tuple(out.shape) == (1, 4, 8, 16)


def test_split_attention_repeats_kv_heads_that_do_not_divide():
    q, k, v = qkv(4, 2)
    gm = capture_graph(attend_gqa, q, k, v)
    assert split_attention(gm, 4, 5) == 1
    repeats = calls(gm, torch.repeat_interleave)
    assert len(repeats) == 2
    for r in repeats:
        assert r.args[1] == 2 and r.kwargs == {"dim": 1}
        assert tuple(r.meta["example_value"].shape) == (1, 4, 8, 16)
        (user,) = r.users
        assert user.target is ops.ALL_TO_ALL
    (node,) = sdpa_nodes(gm)
    assert arg(node, "query").args[0].op == "placeholder"  # query is never repeated
    assert {arg(node, "key").args[0], arg(node, "value").args[0]} == set(repeats)
    assert len(calls(gm, ops.ALL_TO_ALL)) == 4


def test_split_attention_repeat_to_least_common_multiple():
    q, k, v = qkv(6, 3)
    gm = capture_graph(attend_gqa, q, k, v)
    assert split_attention(gm, 2, 1) == 1
    repeats = calls(gm, torch.repeat_interleave)
    assert [r.args[1] for r in repeats] == [2, 2]


def test_split_attention_no_repeat_when_kv_heads_divide():
    q, k, v = qkv(4, 2)
    gm = capture_graph(attend_gqa, q, k, v)
    assert split_attention(gm, 2, 1) == 1
    assert calls(gm, torch.repeat_interleave) == []
    assert len(calls(gm, ops.ALL_TO_ALL)) == 4


def test_split_attention_refuses_heads_that_do_not_split_and_changes_nothing():
    q, k, v = qkv(6, 6)
    gm = capture_graph(attend, q, k, v)
    before = snapshot(gm)
    with pytest.raises(SequenceParallelError, match=r"\b6 attention heads") as e:
        split_attention(gm, 4, 1)
    assert "sequence_parallel_size 4" in str(e.value)
    assert snapshot(gm) == before


def test_split_attention_checks_every_call_before_editing():
    def two_calls(q, k, v, q6):
        return attend(q, k, v).sum() + attend(q6, q6, q6).sum()

    q, k, v = qkv(4, 4)
    gm = capture_graph(two_calls, q, k, v, qkv(6, 6)[0])
    before = snapshot(gm)
    with pytest.raises(SequenceParallelError, match="6 attention heads"):
        split_attention(gm, 4, 1)
    assert snapshot(gm) == before and calls(gm, ops.ALL_TO_ALL) == []


def test_split_attention_refuses_kv_heads_it_cannot_pair():
    # Shapes SDPA would not run (so made up on a symbolic_trace graph): the pass's own checks.
    gm = with_meta(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                   [(1, 4, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16)])
    before = snapshot(gm)
    with pytest.raises(SequenceParallelError, match="3 key/value heads cannot be spread over 2 ranks"):
        split_attention(gm, 2, 1)
    assert snapshot(gm) == before
    gm = with_meta(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                   [(1, 4, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16)])
    with pytest.raises(SequenceParallelError, match="without enable_gqa"):
        split_attention(gm, 2, 1)


def test_split_attention_needs_example_shapes():
    gm = torch.fx.symbolic_trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    before = snapshot(gm)
    with pytest.raises(SequenceParallelError, match=r"\[batch, heads, sequence, head_dim\]"):
        split_attention(gm, 2, 1)
    assert snapshot(gm) == before


@pytest.mark.parametrize("positional", [False, True])
def test_split_attention_replaces_the_mask_with_is_causal(positional):
    if positional:
        def fn(q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, m)
    else:
        def fn(q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    q, k, v = qkv(4, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    gm = capture_graph(fn, q, k, v, mask)
    (node,) = sdpa_nodes(gm)
    assert arg(node, "attn_mask") is not None
    assert split_attention(gm, 2, 3) == 1
    (node,) = sdpa_nodes(gm)
    assert arg(node, "attn_mask") is None
    assert arg(node, "is_causal") is True


def test_split_attention_refuses_mask_with_is_causal():
    gm = with_meta(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True),
                   [(1, 4, 8, 16)] * 3 + [(8, 8)])
    before = snapshot(gm)
    with pytest.raises(SequenceParallelError, match="both a mask and is_causal=True"):
        split_attention(gm, 2, 1)
    assert snapshot(gm) == before


def test_split_attention_without_attention_returns_zero():
    gm = capture_graph(lambda x: torch.relu(x) @ x.T, torch.randn(4, 4))
    before = snapshot(gm)
    assert split_attention(gm, 2, 1) == 0
    assert snapshot(gm) == before


# ------------------------------------------------------------------------------------ config


def test_config_sequence_parallel_size_must_divide_world():
    c = Config.from_dict({**Z3, "sequence_parallel_size": 3})
    assert c.sequence_parallel_size == 3
    with pytest.raises(ConfigError) as e:
        c.resolve(4)
    assert e.value.keys == ["sequence_parallel_size"]
    assert "world size 4" in str(e.value)
    assert c.resolve(6).sequence_parallel_size == 3
    assert Config.from_dict(Z3).sequence_parallel_size == 1


def test_config_sequence_parallel_size_must_be_a_positive_integer():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({**Z3, "sequence_parallel_size": 0})
    assert "sequence_parallel_size" in e.value.keys


def test_config_sequence_parallel_needs_compile():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({**Z3, "sequence_parallel_size": 2, "compile": {"auto_compile": False}})
    assert e.value.keys == ["sequence_parallel_size"]
    assert "auto_compile" in str(e.value)
    Config.from_dict({**Z3, "sequence_parallel_size": 1, "compile": {"auto_compile": False}})
    Config.from_dict({**Z3, "sequence_parallel_size": 2})


def test_config_batch_sizes_count_data_parallel_replicas():
    base = {**Z3, "sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    c = Config.from_dict({**base, "train_batch_size": 4}).resolve(4)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (4, 2, 1)
    with pytest.raises(ConfigError) as e:
        Config.from_dict({**base, "train_batch_size": 8}).resolve(4)
    assert e.value.keys == ["train_batch_size"]
    c = Config.from_dict({**base, "train_batch_size": "auto"}).resolve(4)
    assert c.train_batch_size == 4
    c = Config.from_dict({**Z3, "sequence_parallel_size": 2, "train_batch_size": 8,
                          "train_micro_batch_size_per_gpu": 2}).resolve(4)
    assert c.gradient_accumulation_steps == 2


# ------------------------------------------------------------------------------------ dcsp::all_to_all


def test_all_to_all_fake_kernel_shapes():
    with FakeTensorMode():
        x = torch.empty(2, 4, 8, 16, requires_grad=True)
        y = ops.all_to_all(x, 1, 2, 2, 5)
        assert tuple(y.shape) == (2, 2, 16, 16)
        assert tuple(ops.all_to_all(y, 2, 1, 2, 5).shape) == (2, 4, 8, 16)
        # the adjoint scatters where the forward gathered: the gradient has x's shape
        y.sum().backward()
        assert tuple(x.grad.shape) == (2, 4, 8, 16)
        with pytest.raises(ValueError, match="does not split"):
            ops.all_to_all(torch.empty(2, 3, 8, 16), 1, 2, 2, 5)


def test_all_to_all_kernel_refuses_unknown_group_key():
    with pytest.raises(RuntimeError, match="999999"):
        ops.all_to_all(torch.zeros(2, 4, 8, 16), 1, 2, 2, 999999)
    key = a2a_mod.register_group(object())
    assert key in a2a_mod._GROUPS and a2a_mod.register_group(object()) != key
    a2a_mod.unregister_group(key)
    with pytest.raises(RuntimeError, match=str(key)):
        ops.all_to_all(torch.zeros(2, 4, 8, 16), 1, 2, 2, key)


# ------------------------------------------------------------------------------------ SequenceParallel


def off():
    return SequenceParallel(SequenceParallelGroups(size=1, rank=0, group=None, group_ranks=[0],
                                                   data_parallel_size=1, data_parallel_rank=0))


def test_sequence_parallel_off_is_a_no_op():
    seq = off()
    assert not seq.enabled and seq.size == 1 and seq.group_key == 0
    ids = torch.arange(8).reshape(1, 8)
    mask = torch.ones(1, 8)
    mask[0, 0] = 0
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    out = seq.shard(batch)
    assert type(out) is dict and out is not batch
    assert set(out) == set(batch) and all(out[k] is batch[k] for k in batch)
    loss = torch.tensor(1.5, requires_grad=True)
    assert seq.loss(loss, ids) is loss
    gm = capture_graph(attend, *qkv(4, 4))
    before = snapshot(gm)
    assert seq.rewrite(gm) == 0 and seq.rewritten_calls == 0
    assert snapshot(gm) == before
    assert seq.check_inputs((), {"attention_mask": mask}) is None  # no position_ids, padding mask: not looked at
    seq.close()


def test_sequence_parallel_on_bookkeeping():
    groups = SequenceParallelGroups(size=2, rank=1, group=None, group_ranks=[2, 3],
                                    data_parallel_size=2, data_parallel_rank=1)
    seq = SequenceParallel(groups)
    try:
        assert seq.enabled and seq.size == 2 and seq.rank == 1 and seq.group_key in a2a_mod._GROUPS
        gm = capture_graph(attend, *qkv(4, 4))
        assert seq.rewrite(gm) == 1 and seq.rewritten_calls == 1
        assert {n.args[4] for n in calls(gm, ops.ALL_TO_ALL)} == {seq.group_key}
        ids = torch.arange(8).reshape(1, 8)
        out = seq.shard({"input_ids": ids, "labels": ids}, pad_token_id=0)
        assert torch.equal(out["input_ids"], ids[:, 4:]) and out["position_ids"].tolist() == [[4, 5, 6, 7]]
        # check_inputs decides with the group: tests/sequence_parallel/test_sp_group_decisions.py
    finally:
        key = seq.group_key
        seq.close()
    assert seq.group_key == 0 and key not in a2a_mod._GROUPS


# ------------------------------------------------------------------------------------ global_token_mean


def test_global_token_mean_weighs_slices_by_their_valid_labels(monkeypatch):
    # This rank is rank 0 of 2; rank 1's mean and count are made up.
    others = [torch.tensor(4.0), torch.tensor(1.0)]  # rank 1: loss mean 4 over 1 valid label

    def gather(value, group):
        return torch.stack([value.reshape(()), others.pop(0).to(value.dtype)])

    monkeypatch.setattr(loss_mod._GatherScalars, "apply", staticmethod(gather))
    loss = torch.tensor(1.0, requires_grad=True)
    labels = torch.tensor([[5, 6, 7, IGNORE]])  # 3 valid labels here
    total = sp_pkg.global_token_mean(loss, labels, group=None)
    assert torch.allclose(total, torch.tensor((1.0 * 3 + 4.0 * 1) / 4))
    total.backward()
    assert torch.allclose(loss.grad, torch.tensor(3 / 4))


def test_global_token_mean_ignores_a_slice_without_labels(monkeypatch):
    others = [torch.tensor(2.0), torch.tensor(2.0)]

    def gather(value, group):
        return torch.stack([value.reshape(()), others.pop(0).to(value.dtype)])

    monkeypatch.setattr(loss_mod._GatherScalars, "apply", staticmethod(gather))
    loss = torch.tensor(float("nan"), requires_grad=True)  # the mean over no label
    total = sp_pkg.global_token_mean(loss, torch.full((1, 4), IGNORE), group=None)
    assert total.item() == 2.0
    total.backward()
    assert loss.grad.item() == 0.0


def test_sliding_window_models_are_refused_and_full_attention_ones_pass():
    """The pass gives every token its whole causal prefix: a sliding window would be lost."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from deepcompile.sequence_parallel import SequenceParallel, SequenceParallelError, SequenceParallelGroups

    on = SequenceParallel(SequenceParallelGroups(size=2, rank=0, group=None, group_ranks=[0, 1],
                                                 data_parallel_size=1, data_parallel_rank=0))
    try:
        small = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2)
        with pytest.raises(SequenceParallelError, match="sliding-window"):
            on.check_model(MistralForCausalLM(MistralConfig(**small, sliding_window=4)))
        on.check_model(MistralForCausalLM(MistralConfig(**small, sliding_window=None)))
        on.check_model(LlamaForCausalLM(LlamaConfig(**small)))
    finally:
        on.close()


# ---- the profile (and so the memory plans) sees the all-to-all ------------------------------------

def _a2a_graph(ranks: int, key: int):
    import torch.fx as fx

    from deepcompile import ops

    g = fx.Graph()
    x = g.placeholder("x")
    scaled = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    heads = g.call_function(ops.ALL_TO_ALL, (scaled, 2, 1, ranks, key))  # sequence slices to head slices
    g.output((g.call_function(torch.ops.aten.add.Tensor, (heads, 1.0)),))
    return fx.GraphModule({}, g)


def _profile_all_to_all_body(ctx, fail_on_rank):
    from deepcompile import ops
    from deepcompile.profiling.graph_profiler import GraphProfiler, ProfileAborted
    from deepcompile.sequence_parallel import all_to_all as a2a_mod

    key = a2a_mod.register_group(torch.distributed.group.WORLD)
    try:
        gm = _a2a_graph(ctx.world_size, key)
        x = torch.randn(1, 8, 4, 16)  # [batch, seq slice, heads, dim]: 2 KiB
        names = {n.target: n.name for n in gm.graph.nodes if n.op == "call_function"}
        mul_name, a2a_name = names[torch.ops.aten.mul.Tensor], names[ops.ALL_TO_ALL]
        fail_at = mul_name if ctx.rank == fail_on_rank else None
        profiler = GraphProfiler(gm, graph_id=1, phase="forward", device=ctx.device, fail_at=fail_at)
        if fail_on_rank is not None:
            # A rank that failed before the all-to-all must not leave the others inside it: every
            # rank votes before the collective and stops there.
            with pytest.raises(ProfileAborted, match=f"stopped at node {a2a_name}"):
                profiler.run(x)
            return
        (out,) = profiler.run(x)
        assert out.shape == (1, 8 * ctx.world_size, 4 // ctx.world_size, 16)
        records = profiler.profile.by_name()
        a2a, before = records[a2a_name], records[mul_name]
        nbytes = x.numel() * x.element_size()
        assert a2a.out_bytes == nbytes and a2a.scratch_bytes == nbytes
        # Its input, its output and the exchange buffer are alive together.
        assert a2a.peak_bytes >= before.mem_bytes + 2 * nbytes
        assert profiler.profile.peak_bytes >= a2a.peak_bytes
    finally:
        a2a_mod.unregister_group(key)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("fail_on_rank", [None, 1])
def test_profile_counts_the_all_to_all_buffer_and_votes_before_it(fail_on_rank):
    from _harness.multiproc import run_distributed

    run_distributed(_profile_all_to_all_body, 2, args=(fail_on_rank,), timeout=120)
