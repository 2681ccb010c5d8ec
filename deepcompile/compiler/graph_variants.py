"""One Dynamo graph, compiled once for each set of parameters it is called with.

The backend binds each parameter input of a graph to its ds id when it compiles the graph: the
gathers, releases and gradient reductions it inserts name those ids. Dynamo, however, caches
compiled code per code object and guards on tensor metadata, not identity: a frame that several
layers run (the resumed half of a decoder layer after a graph break, a helper function that
takes a weight as an argument) is compiled once, for the first layer, and then called with the
next layer's parameters. Run as compiled, that graph would gather the first layer's parameters
and reduce every layer's gradients into the first layer's partitions (seen with Qwen2-MoE under
transformers 5.17, where the expert kernel splits each layer's frame: ZeRO-2 gradients of layer
0 carried layer 1's, layer 1's were zero).

So the callable handed back to Dynamo checks, on each call, which parameters sit in the graph's
parameter inputs, and runs the variant compiled for exactly those, compiling a new variant (a
new graph id, its own autograd function, so its backward reduces into the right partitions) the
first time a set is seen. A graph called with its own parameters, the usual case, costs one
dictionary lookup per parameter input.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch.fx import GraphModule

# (graph input index, ds id) of every parameter input, in input order.
Binding = Tuple[Tuple[int, int], ...]


def binding_of(inputs: Sequence[Any], ds_id_of: Dict[int, int]) -> Binding:
    return tuple((i, ds_id_of[id(t)]) for i, t in enumerate(inputs) if id(t) in ds_id_of)


class ParameterBoundGraph:
    """What Dynamo calls for one captured graph: dispatches to the variant of the parameters
    it receives. ``compile_variant(gm, inputs)`` compiles a fresh copy of the captured graph for
    the parameters in ``inputs``."""

    def __init__(self, pristine: GraphModule, first: Callable, binding: Binding,
                 ds_id_of: Dict[int, int], compile_variant: Callable[[GraphModule, List[Any]], Callable],
                 copy_graph: Callable[[GraphModule], GraphModule]):
        self._pristine = pristine
        self._ds_id_of = ds_id_of
        self._compile_variant = compile_variant
        self._copy_graph = copy_graph
        self._first_binding = binding
        self._variants: Dict[Tuple, Callable] = {binding: first}

    def __call__(self, *args: Any):
        if self._compile_variant is None:
            raise RuntimeError("deepcompile: this graph belongs to an engine that was destroyed")
        ds_id_of = self._ds_id_of
        same = all(ds_id_of.get(id(args[i])) == ds_id for i, ds_id in self._first_binding)
        if same:
            return self._variants[self._first_binding](*args)
        key = self._key(args)
        variant = self._variants.get(key)
        if variant is None:
            variant = self._compile_variant(self._copy_graph(self._pristine), list(args))
            self._variants[key] = variant
        return variant(*args)

    def _key(self, args: Sequence[Any]) -> Tuple:
        key: Tuple = binding_of(args, self._ds_id_of)
        # A graph with symbolic sizes is compiled again from concrete inputs: its variants are
        # specialised to the sizes they were compiled for.
        if any(isinstance(a, (int, torch.SymInt)) for a in args):
            key += tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        return key

    def detach(self) -> None:
        self._variants = {}
        self._ds_id_of = {}
        self._compile_variant = None
