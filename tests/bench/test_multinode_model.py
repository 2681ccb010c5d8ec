"""bench/multinode_model.py, whose numbers docs/design/multi-node-plan.md quotes: parameter counts
against the published ones and against transformers, and the bytes and times of small layouts
counted by hand."""

from __future__ import annotations

import sys

import pytest
import torch

from _harness.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from multinode_model import (SHAPES, Layout, LlamaShape, Machine, compute_seconds, main,  # noqa: E402
                             model_state_bytes_per_gpu, predict, step_collectives)

P = 1000  # elements in the hand-counted cases


def by_kind(collectives):
    return {(c.link, c.kind): c for c in collectives}


def test_parameter_counts_are_the_published_ones():
    # The counts the model cards and the loaded checkpoints report.
    assert SHAPES["Llama-3-8B"].parameters() == 8_030_261_248
    assert SHAPES["Llama-3-70B"].parameters() == 70_553_706_496
    assert SHAPES["Llama-2-70B"].parameters() == 68_976_648_192


@pytest.mark.parametrize("shape", [LlamaShape(hidden=64, layers=3, intermediate=172, heads=4, kv_heads=2, vocab=256),
                                   LlamaShape(hidden=48, layers=2, intermediate=100, heads=6, kv_heads=6, vocab=90,
                                              tied_embeddings=True),
                                   SHAPES["Llama-3-8B"]],
                         ids=["gqa", "tied", "llama3-8b"])
def test_parameter_count_is_what_transformers_builds(shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                         tie_word_embeddings=shape.tied_embeddings)
    with torch.device("meta"):  # shapes only: the 8B costs no memory
        model = LlamaForCausalLM(config)
    assert shape.parameters() == sum(p.numel() for p in model.parameters())


def test_plain_zero3_on_two_nodes_of_two_counted_by_hand():
    c = by_kind(step_collectives(P, Layout(nodes=2, gpus_per_node=2, shard=4)))
    assert set(c) == {("shard", "all_gather"), ("shard", "reduce_scatter")}
    # Two gathers of 1000 bf16 elements: 4000 bytes gathered; a ring of 4 sends 3/4 of it.
    assert c["shard", "all_gather"].payload == 4000 and c["shard", "all_gather"].wire == 3000
    # One reduce-scatter of 1000 fp32 gradients: 4000 bytes in, 3000 sent.
    assert c["shard", "reduce_scatter"].payload == 4000 and c["shard", "reduce_scatter"].wire == 3000
    # The ring spans both nodes: what one link of it carries enters each node.
    assert c["shard", "all_gather"].into_node == 3000 and c["shard", "reduce_scatter"].into_node == 3000


def test_hybrid_within_the_node_counted_by_hand():
    c = by_kind(step_collectives(P, Layout(nodes=2, gpus_per_node=2, shard=2)))
    assert c["shard", "all_gather"].wire == 2000 and c["shard", "reduce_scatter"].wire == 2000  # 1/2 of 4000 each
    assert c["shard", "all_gather"].into_node == 0 and c["shard", "reduce_scatter"].into_node == 0
    # Each rank all-reduces its partition, 500 fp32 elements = 2000 bytes, with its one replica:
    # a ring of 2 sends 2 * 1/2 of it. The node's two ranks hold different partitions: two rings
    # enter it.
    replica = c["replica", "all_reduce"]
    assert (replica.ranks, replica.payload, replica.wire, replica.into_node) == (2, 2000, 2000, 4000)


def test_shard_groups_smaller_than_a_node_counted_by_hand():
    # 2 nodes of 4, shard groups of 2: 4 replicas of each partition, 2 on each node, one ring per
    # partition entering each node once; the node holds both partitions (two rings).
    replica = by_kind(step_collectives(P, Layout(nodes=2, gpus_per_node=4, shard=2)))["replica", "all_reduce"]
    assert (replica.ranks, replica.payload, replica.wire, replica.into_node) == (4, 2000, 3000, 6000)
    # One node: nothing leaves it.
    one_node = step_collectives(P, Layout(nodes=1, gpus_per_node=4, shard=2))
    assert all(c.into_node == 0 for c in one_node)


def test_times_and_memory_counted_by_hand():
    # NVLink 2000 B/s, network 1000 B/s into a node.
    machine = Machine(nvlink_bus_gbps=2e-6, node_network_gbps=1e-6, peak_tflops=1e-9, mfu=0.5)
    plain = predict(P, Layout(2, 2, 4), machine, tokens_per_gpu=10)
    # Each collective: max(3000 B over NVLink at 2000 B/s, 3000 B into the node at 1000 B/s) = 3 s.
    assert plain.comm_s == pytest.approx(6.0) and plain.into_node_gb == pytest.approx(6000 / 1e9)
    hybrid = predict(P, Layout(2, 2, 2), machine, tokens_per_gpu=10)
    # Gathers and reduce-scatter 1 s each on NVLink; the all-reduce max(2000 / 2000, 4000 / 1000) = 4 s.
    assert hybrid.comm_s == pytest.approx(6.0) and hybrid.into_node_gb == pytest.approx(4000 / 1e9)
    # 6 FLOPs x 1000 parameters x 10 tokens at half of 1000 FLOP/s.
    assert compute_seconds(P, 10, machine) == pytest.approx(120.0)
    assert plain.step_s == pytest.approx(120.0) and plain.break_even_tokens(10) == pytest.approx(0.5)
    assert model_state_bytes_per_gpu(P, Layout(2, 2, 4)) == 4000 and hybrid.state_gb == pytest.approx(8000 / 1e9)


def test_layouts_that_do_not_tile_the_nodes_are_refused():
    with pytest.raises(ValueError, match="does not divide"):
        Layout(nodes=2, gpus_per_node=2, shard=3)
    with pytest.raises(ValueError, match="neither divides nor is a multiple"):
        Layout(nodes=3, gpus_per_node=8, shard=12)


def test_the_script_prints_both_tables(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["multinode_model.py"])
    main()
    out = capsys.readouterr().out
    assert "Llama-3-70B (70.55 B) | 16 x 8 | hybrid, shard 8" in out and "(does not fit)" in out
    assert "| Llama-3-8B | 2 x 8 | 8 x 400 Gb/s | bf16 |" in out
