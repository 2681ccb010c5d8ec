"""Bytes per link and a step-time model for ZeRO-3 on several nodes, plain against hybrid sharding.

    python3 bench/multinode_model.py [--tokens-per-gpu 8192] [--mfu 0.4] [--markdown]

No GPU, no download: parameter counts come from the models' published shapes (hidden size,
layers, MLP width, attention and key-value heads, vocabulary), the bytes from the collectives one
ZeRO-3 step issues, and the time from link bandwidths that are stated assumptions, all printed
with the tables. docs/design/multi-node-plan.md explains the model and what it predicts;
tests/bench/test_multinode_model.py checks it against hand-counted cases.

The collectives of one optimizer step (no gradient accumulation), for P parameters, a shard group
of ``s`` consecutive ranks and ``r = world / s`` replicas (plain ZeRO-3: ``s = world``, ``r = 1``):

* shard link: two all-gathers of every parameter (forward, then again in the backward: no
  parameter kept gathered) in the gather dtype, and one reduce-scatter of every gradient in the
  reduce dtype;
* replica link (hybrid only): one all-reduce of each rank's gradient partition (P / s elements).

Per rank, under ring algorithms, a collective over n ranks sends ``(n - 1) / n`` of its payload
(all-gather: the gathered output; reduce-scatter: the input), an all-reduce twice that (the
runtime's byte counters, ``engine.step_report.comm_bytes``, report the same "wire" bytes). A ring
whose ranks span several nodes enters each node once, carrying those bytes across the node's
network links; a node carries one such ring per group with ranks on it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, List, Tuple

GB = 1e9


# ---- parameter counts ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The numbers of a Llama config that fix its parameter count."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool = False

    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim  # q, o; k, v
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        norms = 2 * self.hidden  # RMSNorm weights before attention and before the MLP
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)  # input, LM head
        return self.layers * (attention + mlp + norms) + embeddings + self.hidden  # + the final norm


# The published configs (config.json of each model on the Hugging Face hub).
SHAPES: Dict[str, LlamaShape] = {
    "Llama-3-8B": LlamaShape(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    "Llama-2-70B": LlamaShape(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, vocab=32000),
    "Llama-3-70B": LlamaShape(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, vocab=128256),
}


# ---- layouts and bytes ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """``nodes`` x ``gpus_per_node`` ranks, sharded over groups of ``shard`` consecutive ranks."""

    nodes: int
    gpus_per_node: int
    shard: int

    def __post_init__(self):
        world, g, s = self.world, self.gpus_per_node, self.shard
        if world % s:
            raise ValueError(f"shard group size {s} does not divide the world size {world}")
        if s % g and g % s:
            raise ValueError(f"shard group size {s} neither divides nor is a multiple of {g} GPUs per node")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def replicas(self) -> int:
        return self.world // self.shard

    @property
    def name(self) -> str:
        return "plain ZeRO-3" if self.replicas == 1 else f"hybrid, shard {self.shard}"


@dataclasses.dataclass(frozen=True)
class Collective:
    link: str  # "shard" or "replica"
    kind: str  # "all_gather", "reduce_scatter", "all_reduce"
    ranks: int  # of the communicator
    payload: float  # bytes, as the runtime's counters define it
    wire: float  # bytes this rank sends under a ring algorithm
    into_node: float  # bytes entering each node over its network links (0: the ring stays inside nodes)


def ring_wire(kind: str, ranks: int, payload: float) -> float:
    share = (ranks - 1) / ranks
    return payload * (2 * share if kind == "all_reduce" else share)


def step_collectives(numel: float, layout: Layout, gather_bytes: int = 2, reduce_bytes: int = 4,
                     gathers_per_step: int = 2) -> List[Collective]:
    """The collectives one rank issues in one optimizer step, summed per kind. ``numel``: the
    elements sharded (padded to the shard group where the caller counts padding). Defaults:
    bf16 gathers and deepcompile's ZeRO-3 default of fp32 gradient reduction
    (``communication_data_type`` "bf16" makes it 2)."""
    g, s, r = layout.gpus_per_node, layout.shard, layout.replicas
    shard_spans_nodes = s > g
    out = []
    for kind, payload in (("all_gather", gathers_per_step * numel * gather_bytes),
                          ("reduce_scatter", numel * reduce_bytes)):
        wire = ring_wire(kind, s, payload)
        out.append(Collective("shard", kind, s, payload, wire, wire if shard_spans_nodes else 0.0))
    if r > 1:
        payload = numel / s * reduce_bytes
        wire = ring_wire("all_reduce", r, payload)
        # A node holds ranks of min(g, s) replica groups, each a ring that enters it once when the
        # replicas are on more than one node.
        crosses = layout.nodes > 1
        out.append(Collective("replica", "all_reduce", r, payload, wire, min(g, s) * wire if crosses else 0.0))
    return out


def model_state_bytes_per_gpu(numel: float, layout: Layout) -> float:
    """ZeRO-3's sharded model state per GPU: fp32 master (the gather source), fp32 gradient
    partition and Adam's two fp32 moments, 16 bytes per parameter, over the shard group."""
    return 16 * numel / layout.shard


# ---- time ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Machine:
    """Stated assumptions (docs/design/multi-node-plan.md says where each comes from)."""

    nvlink_bus_gbps: float = 360.0  # GB/s: achievable NCCL bus bandwidth within an 8-GPU H100 node
    node_network_gbps: float = 50.0  # GB/s into (and out of) a node: 400 Gb/s
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.4  # fraction of peak the compute reaches
    gpu_memory_gb: float = 80.0


def collective_seconds(c: Collective, machine: Machine) -> float:
    """A ring is as slow as its slowest link: NVLink at the bus bandwidth, the node's network at
    its bandwidth for the bytes entering it."""
    return max(c.wire / (machine.nvlink_bus_gbps * GB), c.into_node / (machine.node_network_gbps * GB))


def compute_seconds(numel: float, tokens_per_gpu: int, machine: Machine) -> float:
    """6 FLOPs per parameter and token (forward 2, backward 4); attention's own FLOPs left out."""
    return 6 * numel * tokens_per_gpu / (machine.mfu * machine.peak_tflops * 1e12)


@dataclasses.dataclass(frozen=True)
class Prediction:
    layout: Layout
    wire_gb: Dict[str, float]  # per link, per rank
    into_node_gb: float
    compute_s: float
    comm_s: float
    state_gb: float

    @property
    def step_s(self) -> float:
        """Communication overlapped with compute as far as it can be: the longer of the two."""
        return max(self.compute_s, self.comm_s)

    def break_even_tokens(self, tokens_per_gpu: int) -> float:
        """Tokens per GPU per step below which communication is longer than compute."""
        return tokens_per_gpu * self.comm_s / self.compute_s


def predict(numel: float, layout: Layout, machine: Machine, tokens_per_gpu: int, **byte_sizes) -> Prediction:
    collectives = step_collectives(numel, layout, **byte_sizes)
    wire: Dict[str, float] = {}
    for c in collectives:
        wire[c.link] = wire.get(c.link, 0.0) + c.wire / GB
    # Collectives on one link run one after the other: their times add (conservative where the
    # gathers and the reductions run on separate streams).
    comm = sum(collective_seconds(c, machine) for c in collectives)
    return Prediction(layout, wire, sum(c.into_node for c in collectives) / GB,
                      compute_seconds(numel, tokens_per_gpu, machine), comm,
                      model_state_bytes_per_gpu(numel, layout) / GB)


# ---- the tables -----------------------------------------------------------------------------------

# (model, nodes, shard group sizes compared): plain (the world) first, then hybrid layouts.
CASES: List[Tuple[str, int, Tuple[int, ...]]] = [
    ("Llama-3-8B", 2, (16, 8)),
    ("Llama-3-8B", 16, (128, 8)),
    ("Llama-3-70B", 2, (16, 8)),
    ("Llama-3-70B", 16, (128, 8, 16, 32)),
    ("Llama-2-70B", 16, (128, 8, 32)),
]


def table(machine: Machine, tokens_per_gpu: int, gpus_per_node: int = 8) -> str:
    rows = ["| model (params) | nodes x GPUs | layout | wire GB/rank: shard, replica | GB into each node | "
            "model state GB/GPU | compute s | comm s | step s | comm hidden above tokens/GPU |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, nodes, shards in CASES:
        numel = SHAPES[model].parameters()
        for shard in shards:
            p = predict(numel, Layout(nodes, gpus_per_node, shard), machine, tokens_per_gpu)
            fits = "" if p.state_gb < machine.gpu_memory_gb else " (does not fit)"
            rows.append(f"| {model} ({numel / 1e9:.2f} B) | {nodes} x {gpus_per_node} | {p.layout.name} | "
                        f"{p.wire_gb.get('shard', 0):.1f}, {p.wire_gb.get('replica', 0):.1f} | {p.into_node_gb:.1f} | "
                        f"{p.state_gb:.1f}{fits} | {p.compute_s:.2f} | {p.comm_s:.2f} | {p.step_s:.2f} | "
                        f"{p.break_even_tokens(tokens_per_gpu):,.0f} |")
    return "\n".join(rows)


# Where the assumptions matter most: plain against hybrid within the node, one 400 Gb/s link per
# node or eight (one per GPU, as DGX/HGX H100 nodes have), fp32 or bf16 gradient reduction.
VARIANTS: List[Tuple[str, float, int]] = [("1 x 400 Gb/s", 50.0, 4), ("1 x 400 Gb/s", 50.0, 2),
                                          ("8 x 400 Gb/s", 400.0, 4), ("8 x 400 Gb/s", 400.0, 2)]


def variants_table(machine: Machine, tokens_per_gpu: int, gpus_per_node: int = 8) -> str:
    rows = ["| model | nodes x GPUs | network per node | reduce dtype | GB into each node: plain, hybrid | "
            "comm s: plain, hybrid | step s: plain, hybrid |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, nodes in (("Llama-3-8B", 2), ("Llama-3-8B", 16), ("Llama-3-70B", 2), ("Llama-3-70B", 16)):
        numel = SHAPES[model].parameters()
        for network, gbps, reduce_bytes in VARIANTS:
            m = dataclasses.replace(machine, node_network_gbps=gbps)
            plain, hybrid = (predict(numel, Layout(nodes, gpus_per_node, shard), m, tokens_per_gpu,
                                     reduce_bytes=reduce_bytes) for shard in (nodes * gpus_per_node, gpus_per_node))
            rows.append(f"| {model} | {nodes} x {gpus_per_node} | {network} | {'fp32' if reduce_bytes == 4 else 'bf16'} | "
                        f"{plain.into_node_gb:.1f}, {hybrid.into_node_gb:.1f} | {plain.comm_s:.2f}, {hybrid.comm_s:.2f} | "
                        f"{plain.step_s:.2f}, {hybrid.step_s:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--mfu", type=float, default=Machine.mfu)
    parser.add_argument("--nvlink-gbps", type=float, default=Machine.nvlink_bus_gbps)
    parser.add_argument("--network-gbps", type=float, default=Machine.node_network_gbps,
                        help="GB/s into a node (50: one 400 Gb/s link; 400: eight)")
    args = parser.parse_args()
    machine = Machine(nvlink_bus_gbps=args.nvlink_gbps, node_network_gbps=args.network_gbps, mfu=args.mfu)
    print("parameters: " + ", ".join(f"{m} {s.parameters():,}" for m, s in SHAPES.items()))
    print(f"assumptions: {machine}, {args.tokens_per_gpu} tokens per GPU per step, bf16 gathers, fp32 reductions")
    print(table(machine, args.tokens_per_gpu))
    print()
    print(variants_table(machine, args.tokens_per_gpu))


if __name__ == "__main__":
    main()
