"""Where a model's parameter lives in Hugging Face files: under its own name, or, for a few
transformers models, in the library's original checkpoint format.

transformers 5 fuses some weights when it loads them and splits them again when it saves: a
Qwen2-MoE layer computes with one ``mlp.experts.gate_up_proj`` tensor of shape (experts,
2 * inner, hidden), while ``save_pretrained`` writes ``mlp.experts.<e>.gate_proj.weight`` and
``mlp.experts.<e>.up_proj.weight`` for every expert ``e`` (``transformers.conversion_mapping``).
A parameter is read here through a :class:`Source`: one stored tensor, or a stack or join of
sources, read piece by piece so that a rank still reads only the elements it owns. The
conversions understood are the two such models use: stacking per-expert tensors along a new
first dimension (``MergeModulelist(dim=0)``), optionally followed by joining the stacks along
one dimension (``Concatenate``). A parameter that transformers stores in another converted form
must be present under its own name.

Renamings of legacy checkpoints (``LayerNorm.gamma`` ...) are not applied: names in the files are
the module's ``state_dict`` names.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from deepcompile.checkpoint.safetensors_files import Index, SafetensorsWeights


class Source(abc.ABC):
    """A full parameter as it is stored: ``names`` of the stored tensors it is made of,
    ``shape`` from their shapes, ``read`` of one rectangular piece."""

    @abc.abstractmethod
    def names(self) -> List[str]:
        ...

    @abc.abstractmethod
    def shape(self, shapes: Dict[str, torch.Size]) -> torch.Size:
        """Raises ValueError when the stored tensors do not fit together."""

    @abc.abstractmethod
    def read(self, weights: SafetensorsWeights, index: Index) -> torch.Tensor:
        ...


@dataclasses.dataclass
class Stored(Source):
    name: str

    def names(self) -> List[str]:
        return [self.name]

    def shape(self, shapes):
        return shapes[self.name]

    def read(self, weights, index):
        return weights.read(self.name, index)


@dataclasses.dataclass
class Stacked(Source):
    """``torch.stack(parts)``: part ``i`` is element ``i`` of the first dimension."""

    parts: List[Source]

    def names(self):
        return [n for p in self.parts for n in p.names()]

    def shape(self, shapes):
        inner = {tuple(p.shape(shapes)) for p in self.parts}
        if len(inner) != 1:
            raise ValueError(f"the stacked tensors differ in shape: {sorted(inner)}")
        return torch.Size((len(self.parts),) + inner.pop())

    def read(self, weights, index):
        rows = index[0]
        return torch.stack([self.parts[i].read(weights, index[1:]) for i in range(rows.start, rows.stop)])


@dataclasses.dataclass
class Joined(Source):
    """``torch.cat(parts, dim)``."""

    dim: int
    parts: List[Source]
    _extents: Optional[List[int]] = None  # each part's size along ``dim``, from ``shape``

    def names(self):
        return [n for p in self.parts for n in p.names()]

    def shape(self, shapes):
        part_shapes = [p.shape(shapes) for p in self.parts]
        others = {s[: self.dim] + s[self.dim + 1:] for s in part_shapes}
        if len(others) != 1 or any(len(s) <= self.dim for s in part_shapes):
            raise ValueError(f"the joined tensors do not fit together along dimension {self.dim}: "
                             f"{[tuple(s) for s in part_shapes]}")
        self._extents = [s[self.dim] for s in part_shapes]
        full = list(part_shapes[0])
        full[self.dim] = sum(self._extents)
        return torch.Size(full)

    def read(self, weights, index):
        want = index[self.dim]
        pieces, offset = [], 0
        for part, extent in zip(self.parts, self._extents):
            lo, hi = max(want.start, offset), min(want.stop, offset + extent)
            if hi > lo:
                local = index[: self.dim] + (slice(lo - offset, hi - offset),) + index[self.dim + 1:]
                pieces.append(part.read(weights, local))
            offset += extent
        return torch.cat(pieces, dim=self.dim)


# ---- transformers' conversions ------------------------------------------------------------------

_PLAIN_PATTERN = re.compile(r"[A-Za-z0-9_.*]+")


@dataclasses.dataclass
class Conversion:
    """One of transformers' ``WeightConverter``s, for the parameters below ``scope``."""

    scope: str  # module prefix ("" or "model." style, with the dot)
    sources: List[str]  # stored-name patterns, ``*`` standing for the expert index
    target: str  # the parameter's name suffix
    join_dim: Optional[int]  # Concatenate(dim) after stacking; None: stacking only
    unsupported: Optional[str] = None  # why this conversion cannot be read or written here

    def matches(self, name: str) -> bool:
        if not name.startswith(self.scope):
            return False
        local = name[len(self.scope):]
        return local == self.target or local.endswith("." + self.target)

    def stored_names(self, name: str, experts: int) -> List[List[str]]:
        """Stored names of parameter ``name`` by source pattern, then by expert."""
        base = name[: len(name) - len(self.target)]
        return [[base + pattern.replace("*", str(e)) for e in range(experts)] for pattern in self.sources]

    def source(self, name: str, shape: torch.Size) -> Source:
        stacks = [Stacked([Stored(n) for n in names]) for names in self.stored_names(name, shape[0])]
        return stacks[0] if self.join_dim is None else Joined(self.join_dim, stacks)

    def split(self, name: str, full: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
        """The stored tensors of parameter ``name`` with values ``full`` (views of it)."""
        names = self.stored_names(name, full.shape[0])
        if self.join_dim is None:
            parts = [full]
        else:
            if full.shape[self.join_dim] % len(self.sources):
                raise ValueError(f"{name}: dimension {self.join_dim} of shape {tuple(full.shape)} does not "
                                 f"split into {len(self.sources)} equal parts")
            parts = full.chunk(len(self.sources), dim=self.join_dim)
        for part, part_names in zip(parts, names):
            for e, stored in enumerate(part_names):
                yield stored, part[e]


def _describe(op) -> str:
    return f"{type(op).__name__}({', '.join(f'{k}={v}' for k, v in vars(op).items())})"


def _from_transformers(scope: str, transform) -> Optional[Conversion]:
    if type(transform).__name__ != "WeightConverter":
        return None  # renamings of legacy names: not applied (module docstring)
    sources, targets = list(transform.source_patterns), list(transform.target_patterns)
    scope = scope + (transform.scope_prefix + "." if getattr(transform, "scope_prefix", None) else "")
    ops = list(getattr(transform, "operations", []))
    kinds = [type(op).__name__ for op in ops]
    conversion = Conversion(scope, sources, targets[0] if targets else "", None)
    plain = len(targets) == 1 and all(_PLAIN_PATTERN.fullmatch(p) for p in sources + targets) \
        and all(p.count("*") == 1 for p in sources) and "*" not in targets[0]
    if plain and kinds == ["MergeModulelist"] and ops[0].dim == 0 and len(sources) == 1:
        return conversion
    if plain and kinds == ["MergeModulelist", "Concatenate"] and ops[0].dim == 0:
        conversion.join_dim = ops[1].dim
        return conversion
    conversion.unsupported = f"{sources} -> {targets} by {', '.join(_describe(op) for op in ops)}"
    return conversion


def transformers_conversions(module: nn.Module) -> List[Conversion]:
    """The weight conversions transformers applies to the transformers models in ``module`` (the
    outermost ones: a model's own list covers its sub-models)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # no transformers, or one older than its conversion mappings
        return []
    found: List[Conversion] = []
    covered: List[str] = []
    for prefix, sub in module.named_modules():
        if not isinstance(sub, PreTrainedModel) or any(prefix.startswith(c) for c in covered):
            continue
        scope = prefix + "." if prefix else ""
        covered.append(scope)
        for transform in get_model_conversion_mapping(sub) or []:
            conversion = _from_transformers(scope, transform)
            if conversion is not None:
                found.append(conversion)
        if not prefix:
            break
    return found


def conversion_for(name: str, conversions: Sequence[Conversion]) -> Optional[Conversion]:
    return next((c for c in conversions if c.matches(name)), None)
