"""Regional compilation: each repeated block (a decoder layer) compiled on its own, as FSDP2 users
do, instead of the whole model as one graph.

Dynamo captures identical blocks once and the backend compiles that capture once, running it for
every block's parameters (compiler/graph_instances.py). Compile time then grows with the number
of *distinct* blocks, not with depth: a 32-layer model compiles about one layer's graph (plus one
more for the first layer, whose input does not require grad). What lies outside the blocks
(embeddings, the final norm, the head) runs eagerly, its parameters gathered by the eager hooks,
which find them in flight: the prefetch chain launches them while the unit before runs
(compiler/eager_units.py, scheduling/instance_chain.py).

Which modules are blocks: the classes a Hugging Face model names in ``_no_split_modules`` (the
modules it never splits across devices: its layers), or the classes (or class names) the caller
lists.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Sequence, Union

import torch.nn as nn

from deepcompile import compat

log = logging.getLogger(__name__)

RegionSpec = Union[bool, Sequence[Union[str, type]]]


def _no_split_names(model: nn.Module) -> List[str]:
    names: List[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if name not in names:
                names.append(name)
    return names


def find_regions(model: nn.Module, spec: RegionSpec) -> List[nn.Module]:
    """The modules to compile one by one: instances of the classes ``spec`` names (True: the
    model's ``_no_split_modules``), outermost first; a block inside another block is compiled as
    part of it. Raises when nothing matches."""
    if spec is True:
        wanted: Iterable[Union[str, type]] = _no_split_names(model)
        if not wanted:
            raise ValueError(
                "deepcompile: regional compilation needs to know the model's repeated blocks: the model names no "
                "_no_split_modules; pass them, e.g. engine.compile(regional=[MyDecoderLayer])")
    elif isinstance(spec, (list, tuple)) and spec:
        wanted = spec
    else:
        raise ValueError(f"deepcompile: regional must be True or a non-empty list of module classes or class "
                         f"names, got {spec!r}")
    classes = {w for w in wanted if isinstance(w, type)}
    names = {w for w in wanted if isinstance(w, str)}
    bad = [w for w in wanted if not isinstance(w, (str, type))]
    if bad:
        raise ValueError(f"deepcompile: regional entries must be module classes or class names, got {bad!r}")
    regions: List[nn.Module] = []
    inside: set = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, tuple(classes)) or type(module).__name__ in names:
            regions.append(module)
            inside.update(id(m) for m in module.modules())
    if not regions:
        listed = sorted({c.__name__ for c in classes} | names)
        raise ValueError(f"deepcompile: regional compilation found no module of the classes {listed} in the model")
    return regions


def warn_if_layers_differ(model: nn.Module) -> None:
    """transformers models fill a KV cache in every forward unless ``use_cache`` is off; each
    layer then finds the cache in another state, Dynamo compiles the layer again for each one
    (up to its recompile limit, past which layers run eagerly), and nothing is shared."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            log.warning("deepcompile: regional compilation of a model with config.use_cache=True: unless its forward is "
                        "called with use_cache=False, every layer sees "
                        "the KV cache in another state and is compiled again; train with use_cache=False")
            return


def compile_regions(regions: Sequence[nn.Module], backend: Any, kwargs: Dict[str, Any]) -> None:
    """Compile each region in place (``nn.Module.compile``) with ``backend``."""
    for module in regions:
        module.compile(backend=backend, **kwargs)


def uncompile_regions(regions: Sequence[nn.Module]) -> None:
    """Undo ``compile_regions``: the modules run their plain forward again."""
    for module in regions:
        compat.drop_module_compile(module)
