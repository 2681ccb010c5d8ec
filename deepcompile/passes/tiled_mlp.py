"""The tiled-MLP pass (``compile.tiled_mlp``): gated MLPs without their intermediate activations.

It runs on the graph Dynamo captured (and the subgraphs of activation-checkpointed regions),
before aot_autograd. It looks for the gated MLP of Llama, Qwen2, Mistral and Gemma,
``linear(act(linear(x, gate)) * linear(x, up), down)`` with ``act`` SiLU or GELU (exact or tanh)
and no biases, and replaces the four steps with ``dcmlp::gated_mlp(x, gate, up, down)``, which
computes them a chunk of tokens at a time and recomputes each chunk in the backward
(passes/tiled_mlp_kernels.py). What is saved for the backward is then the MLP's input only, not
four ``tokens x intermediate`` tensors; the price is the gate and up matmuls once more in the
backward. An intermediate read by anything else (a returned hidden state, a hook) keeps the MLP
as it is.

This is ALST's tiled MLP (DeepSpeed's ``TiledMLP``) as a graph pass: the model code is unchanged.
Per token, so it composes with sequence parallelism (each rank tiles its slice).
"""

from __future__ import annotations

import operator
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from deepcompile import ops
from deepcompile.passes import tiled_mlp_kernels  # noqa: F401  (registers the kernels)
from deepcompile.passes.tiled_pass import TiledPass
from deepcompile.passes.tiling_choice import TilingChoice

_LINEAR = (F.linear,)  # torch._C._nn.linear itself: Dynamo records that object
_MUL = (operator.mul, torch.mul, torch.Tensor.mul)
# Bytes of one chunk's intermediate (per tensor, at 4 bytes an element) when
# compile.tiled_mlp_chunk_tokens is 0 (auto).
AUTO_CHUNK_BYTES = 256 * 1024 * 1024


class GatedMLP(NamedTuple):
    down: Node  # the last linear: its output is the MLP's
    x: Node
    gate: Node
    up: Node
    down_weight: Node
    activation: str
    inner: List[Node]  # the nodes the op replaces (gate and up linears, the activation, the product)


def chunk_tokens(intermediate: int, configured: int) -> int:
    """Tokens per chunk: ``configured``, or (0) as many as keep one intermediate within AUTO_CHUNK_BYTES."""
    return configured if configured > 0 else max(1, AUTO_CHUNK_BYTES // (4 * intermediate))


def _linear_parts(node: Node):
    """(input, weight) of a bias-free ``F.linear`` call, else None."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target not in _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    bias = args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    weight = args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if bias is not None or weight is None:
        return None
    return node.args[0], weight


def _activation(node: Node) -> Optional[str]:
    """The name of the activation ``node`` computes (tiled_mlp_kernels.ACTIVATIONS), else None."""
    if not isinstance(node, Node) or node.op != "call_function" or len(node.args) != 1:
        return None
    if node.target is F.silu and not node.kwargs.get("inplace", False):
        return "silu"
    if node.target is F.gelu:
        approximate = node.kwargs.get("approximate", "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def _only_user_is(node: Node, user: Node) -> bool:
    return list(node.users) == [user]


def _match(down: Node) -> Optional[GatedMLP]:
    parts = _linear_parts(down)
    if parts is None:
        return None
    product, down_weight = parts
    if not isinstance(product, Node) or product.op != "call_function" or product.target not in _MUL \
            or len(product.args) != 2 or product.kwargs or not _only_user_is(product, down):
        return None
    for activated, upped in (product.args, reversed(product.args)):
        activation = _activation(activated)
        gate_parts, up_parts = (_linear_parts(activated.args[0]) if activation else None), _linear_parts(upped)
        if gate_parts is None or up_parts is None or gate_parts[0] is not up_parts[0]:
            continue
        gate_node = activated.args[0]
        if not (_only_user_is(activated, product) and _only_user_is(gate_node, activated)
                and _only_user_is(upped, product)):
            continue
        return GatedMLP(down, gate_parts[0], gate_parts[1], up_parts[1], down_weight, activation,
                        [gate_node, activated, upped, product])
    return None


def _graphs(gm: GraphModule) -> List[GraphModule]:
    return [m for _, m in gm.named_modules() if isinstance(m, GraphModule)]


def find_mlps(gm: GraphModule) -> List[GatedMLP]:
    """Every gated MLP of ``gm`` itself (not its subgraphs) the pass can tile."""
    found = []
    for node in gm.graph.nodes:
        mlp = _match(node)
        if mlp is not None:
            found.append(mlp)
    return found


def _intermediate(mlp: GatedMLP) -> int:
    example = mlp.inner[0].meta.get("example_value")
    return int(example.shape[-1]) if isinstance(example, torch.Tensor) else 1


def held_bytes(mlp: GatedMLP) -> int:
    """What autograd holds of the MLP's intermediates for the backward, untiled: the gate's and
    up projection's outputs, the activation and their product (from the traced shapes)."""
    example = mlp.inner[0].meta.get("example_value")
    if not isinstance(example, torch.Tensor):
        return 0
    return 4 * example.numel() * example.element_size()


def tile_mlps(gm: GraphModule, configured_chunk: int, choice: TilingChoice = None) -> int:
    """Replace the gated MLPs of ``gm`` and its subgraphs that ``choice`` wants (default: all; see
    the module's doc); returns how many."""
    choice = choice if choice is not None else TilingChoice(True)
    total = 0
    for graph_module in _graphs(gm):
        graph = graph_module.graph
        mlps = [mlp for mlp in find_mlps(graph_module) if choice.wants(held_bytes(mlp))]
        for mlp in mlps:
            with graph.inserting_before(mlp.down):
                tiled = graph.call_function(ops.GATED_MLP, (mlp.x, mlp.gate, mlp.up, mlp.down_weight, mlp.activation,
                                                            chunk_tokens(_intermediate(mlp), configured_chunk)))
            tiled.meta.update(mlp.down.meta)
            mlp.down.replace_all_uses_with(tiled)
            graph.erase_node(mlp.down)
            for node in reversed(mlp.inner):  # product, then what fed it
                graph.erase_node(node)
        if mlps:
            graph.lint()
            graph_module.recompile()
        total += len(mlps)
    return total


class TiledMLP(TiledPass):
    """``compile.tiled_mlp``'s pass (passes/tiled_pass.py) with this module's ``tile_mlps``."""

    def __init__(self, configured_chunk: int, choice: TilingChoice = None):
        super().__init__(tile_mlps, configured_chunk, choice)
