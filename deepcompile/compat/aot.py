"""aot_autograd: building the backend, partitioning joint graphs, and the layout conventions of
the graphs it hands to our compilers (which input is which, which output is whose gradient)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, TypeVar

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

V = TypeVar("V")

# aot_autograd names the joint graph's forward inputs primals_1, primals_2, ... (and the incoming
# gradients tangents_1, ...).
_PRIMAL_PREFIX = "primals_"


def aot_backend(fw_compiler: Callable, bw_compiler: Callable, partition_fn: Callable,
                decompositions: Optional[Dict[Any, Callable]] = None) -> Callable:
    """A Dynamo backend ``(gm, example_inputs) -> callable`` that traces the joint graph, splits
    it with ``partition_fn`` and compiles the halves with the given compilers (``fw_compiler``
    also compiles graphs that need no backward). Relies on
    ``torch._dynamo.backends.common.aot_autograd``."""
    from torch._dynamo.backends.common import aot_autograd

    kwargs: Dict[str, Any] = dict(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                  inference_compiler=fw_compiler, partition_fn=partition_fn)
    if decompositions is not None:
        kwargs["decompositions"] = decompositions
    return aot_autograd(**kwargs)


def min_cut_partition(joint: GraphModule, joint_inputs: Any, **kwargs: Any):
    """aot_autograd's min-cut rematerialization partitioner (what Inductor uses); keyword
    arguments (``num_fwd_outputs`` ...) are aot_autograd's and passed through. Relies on
    ``torch._functorch.partitioners.min_cut_rematerialization_partition``."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def boxed(fn: Callable) -> Callable:
    """``fn`` as a compiled graph half aot_autograd calls with one argument list.
    Relies on ``functorch.compile.make_boxed_func``."""
    from functorch.compile import make_boxed_func

    return make_boxed_func(fn)


def mark_boxed(obj: Any) -> None:
    """Tell aot_autograd to call ``obj`` with one argument list (which the callee may clear to
    free inputs early) instead of unpacked arguments. The flag is an instance attribute, so
    ``functools.wraps`` copies it onto wrappers. Relies on the ``_boxed_call`` attribute."""
    obj._boxed_call = True


def joint_primal_inputs(joint: GraphModule) -> List[Node]:
    """The joint graph's forward inputs, in the order of Dynamo's graph inputs."""
    return [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith(_PRIMAL_PREFIX)]


def forward_inputs(gm: GraphModule) -> List[Node]:
    """The placeholders of a forward (or inference) graph half: Dynamo's graph inputs, in order."""
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def saved_forward_inputs(backward: GraphModule, forward_names: Dict[str, V]) -> Dict[Node, V]:
    """The backward graph's placeholders that are forward inputs saved for backward, keyed to
    ``forward_names[name]``: the partitioner keeps a saved input's placeholder name."""
    return {n: forward_names[n.name] for n in backward.graph.nodes
            if n.op == "placeholder" and n.name in forward_names}


def gradient_output_index(input_index: int) -> int:
    """Position, among the backward graph's outputs, of the gradient of forward input
    ``input_index``: aot_autograd returns one output per forward input, in input order (None
    for inputs without a gradient)."""
    return input_index


def mark_must_recompute(joint: GraphModule, nodes: Iterable[Node]) -> None:
    """Make the partitioner recompute ``nodes`` in the backward instead of saving them.

    Uses the activation-checkpointing tags the partitioner reads: ``meta["recompute"]``, and
    ``meta["ac_graph_id"]``, which it compares between a tagged node and its users and therefore
    expects on every node once any node is tagged.
    """
    for node in joint.graph.nodes:
        node.meta.setdefault("ac_graph_id", 1)
    for node in nodes:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


_TANGENT_PREFIX = "tangents_"


def partition_forward_output_count(partition_kwargs: Dict[str, Any]) -> Optional[int]:
    """How many of the forward graph's outputs the caller sees (mutated inputs, user outputs,
    intermediate bases); the rest are saved for backward. aot_autograd hands it to the partition
    function as the ``num_fwd_outputs`` keyword (None if a version stops doing so)."""
    n = partition_kwargs.get("num_fwd_outputs")
    return int(n) if n is not None else None


def is_incoming_gradient(placeholder: Node) -> bool:
    """True for a backward placeholder that is an incoming gradient (aot_autograd names them
    ``tangents_1`` ...), False for a value saved by the forward."""
    return placeholder.op == "placeholder" and placeholder.name.startswith(_TANGENT_PREFIX)


def save_forward_input_for_backward(forward: GraphModule, backward: GraphModule, input_index: int,
                                    num_fwd_outputs: int, name: str) -> Node:
    """Make forward input ``input_index`` a value saved for the backward, as the first saved
    tensor, and return the backward's new placeholder for it (named ``name``).

    Relies on aot_autograd's partition layout: the forward returns its ``num_fwd_outputs``
    outputs, then the saved tensors, then saved symbolic ints; the backward takes the saved
    symbolic ints, then the saved tensors, then the incoming gradients. aot_autograd counts the
    saved values from the graphs after the partition function returns, so adding one there is
    consistent. The output descriptors (``meta["desc"]``, one per output) get one more entry.
    """
    source = forward_inputs(forward)[input_index]
    output = forward.graph.output_node()
    outputs = list(output.args[0])
    outputs.insert(num_fwd_outputs, source)
    output.args = (tuple(outputs),)
    descs = output.meta.get("desc")
    if isinstance(descs, list) and len(descs) == len(outputs) - 1 and len(descs) > num_fwd_outputs:
        descs.insert(num_fwd_outputs, descs[num_fwd_outputs])
    elif isinstance(descs, list) and len(descs) == len(outputs) - 1:
        output.meta.pop("desc")  # nothing saved before: no descriptor of a saved value to copy

    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    leading_symbols = 0
    for node in placeholders:
        if isinstance(node.meta.get("val"), torch.SymInt):
            leading_symbols += 1
        else:
            break
    if leading_symbols < len(placeholders):
        with backward.graph.inserting_before(placeholders[leading_symbols]):
            saved = backward.graph.placeholder(name)
    else:
        with backward.graph.inserting_after(placeholders[-1]) if placeholders else backward.graph.inserting_before():
            saved = backward.graph.placeholder(name)
    saved.meta["val"] = source.meta.get("val")
    forward.recompile()
    backward.recompile()
    return saved
