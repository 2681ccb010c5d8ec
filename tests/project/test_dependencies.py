"""How the package's modules may depend on each other and on torch (read from the source, no import).

What counts as a dependency: every ``import``/``from ... import`` anywhere in a file, at module
level or inside a function (a deferred import hides a dependency from the reader, not from the
design). ``from deepcompile.zero import stage3`` is an edge to the module
``deepcompile.zero.stage3``; ``from deepcompile.zero.stage3 import Zero3Sharding`` one to
``deepcompile.zero.stage3``. ``deepcompile._C`` (the C++ extension) is a leaf outside the graph.

The package ``deepcompile/__init__.py`` is the public front: it imports what users name
(``deepcompile.initialize``), and nothing inside the package imports it back for those names.
``from deepcompile import compat`` names the module ``deepcompile.compat`` and is fine; importing
``deepcompile`` itself, or a name defined in its ``__init__``, is not. (Python runs
``deepcompile/__init__.py`` first whatever a module imports, so at run time everything is
reachable from everything; what keeps the design layered is that the module-to-module graph
read here has no circle.)

The rules, checked below:

* ``LAYERS``: per unit of the package (a sub-package or a top-level module), the units it may
  import. It reads bottom-up: a unit imports only what appears on its row, and the rows form
  no circle. A new unit fails ``test_every_unit_has_a_row`` until it gets one.
* The module-level import graph has no circle (``test_no_import_circle``).
* ``checkpoint/`` takes the training state as a value: it neither imports the engine (its row)
  nor assigns into it.
* ``config`` is data: its modules load neither torch nor the C++ extension at import.
* Private torch surface (``torch._*``, ``torch.utils._*``, ``functorch``) is reached only from
  ``compat/``, so that a torch upgrade breaks in one place.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from _harness.source_names import dotted
from _harness.paths import ROOT

PACKAGE = os.path.join(ROOT, "deepcompile")
EXTENSION = "deepcompile._C"

# Each unit's row: the units (or, where only one module of a unit is meant, "unit.module") it may
# import. Bottom-up: a row names only rows above it in this table.
LAYERS: Dict[str, Tuple[str, ...]] = {
    # The ground floor: torch's private surface behind one door, and plain data or helpers.
    "compat": (),
    "logging_setup": (),
    "progress": (),
    "precision": (),
    "step_report": (),
    # The one line that says what runs (run_summary.py): reads the config's offload rules.
    "run_summary": ("config",),
    # The memory budget every planner shares (memory/budget.py): torch only.
    "memory": (),
    # Config is data: it names the runtime's settings and the passes, it does not load them.
    "config": (),
    "optim_builder": ("config",),
    # The C++ runtime's Python face, and what builds on it without knowing the engine (reading
    # the config's cross-feature rules, config/rules.py, where it needs them).
    "runtime": ("_C", "compat"),
    # Every custom op (deepcompile/ops.py): the extension's and the Python-defined ones; the
    # debug checks read graphs for them.
    "ops": ("_C",),
    "debug_checks": ("ops",),
    "profiling": ("compat", "ops", "runtime"),
    "offload": ("_C", "compat", "config", "memory", "ops", "runtime"),
    # ZeRO stages: plug-in points (StateAccess, sub-group hooks) are declared here and filled by
    # offload/ through the engine, so zero/ does not know which offload kinds exist.
    "zero": ("compat", "debug_checks", "ops", "precision", "runtime"),
    # Graph passes insert runtime ops and the activation-offload ops, nothing of the planners.
    "passes": ("compat", "ops", "runtime", "offload.activation_ops"),
    # Ulysses sequence parallelism: its groups, the all-to-all's kernel (ops.py holds the op) and
    # the attention pass over the captured graph, which the compiler runs without knowing it; the
    # model-config check it shares with the causal-mask pass (sliding windows).
    "sequence_parallel": ("ops", "passes.causal_mask"),
    # The scheduler decides plans from profiles; the backend applies them (compiler/replan.py).
    "scheduling": ("compat", "config", "memory", "ops", "runtime", "profiling"),
    "compiler": ("compat", "debug_checks", "offload", "ops", "passes", "profiling", "runtime", "scheduling",
                 "zero"),
    # Liveness of the ranks over the process group's store (faults/): its hooks name no feature.
    "faults": ("compat",),
    # Checkpoints read and restore a TrainingState value through zero's Sharding interface (and
    # the saved config's dtypes through the precision policy); tests kill a rank at named points
    # of the save (faults/injection.py).
    "checkpoint": ("precision", "zero", "faults.injection"),
    # The loop's optional features as parts with declared hooks, and the one builder of their
    # ordered list (parts.py): what the engine calls, never the engine itself.
    "parts": ("debug_checks", "memory", "offload", "runtime", "step_report"),
    # The loop: composes everything above.
    "engine": ("checkpoint", "compat", "compiler", "config", "debug_checks", "faults", "logging_setup", "memory",
               "offload", "ops", "optim_builder", "parts", "passes", "precision", "profiling", "progress", "runtime",
               "run_summary", "scheduling", "sequence_parallel", "step_report", "zero"),
}
# Fronts over the engine (DeepSpeed's import paths, the command line): they may use any unit
# above, never one another; ``python -m deepcompile`` runs the command line.
FRONTS = ("cli", "integrations")
LAYERS.update({front: ("_C", *LAYERS) for front in FRONTS})
LAYERS["__main__"] = ("cli",)


# ---- reading the source -------------------------------------------------------------------------


def _module_name(relpath: str) -> str:
    parts = ["deepcompile", *relpath[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> Iterator[Tuple[str, str, ast.AST]]:
    """(path relative to deepcompile/, module name, syntax tree) of every file of the package."""
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
                with open(path, encoding="utf-8") as f:
                    yield rel, _module_name(rel), ast.parse(f.read(), path)


SOURCES = list(_sources())
FILE_OF = {module: rel for rel, module, _ in SOURCES}
MODULES = set(FILE_OF) | {EXTENSION}


def _containing_module(name: str) -> str:
    """``name`` if it is a module of the package, else the longest module prefix of it (a name
    imported from a module belongs to that module); "" for names outside the package."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return ""


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if FILE_OF[module].endswith("__init__.py") else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(module: str, tree: ast.AST) -> Iterator[Tuple[str, int, str]]:
    """(imported module, line, the import as written) for every import of the package in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _containing_module(alias.name)
                if target:
                    yield target, node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                target = _containing_module(f"{source}.{alias.name}") or _containing_module(source)
                if target:
                    yield target, node.lineno, f"from {'.' * node.level}{node.module or ''} import {alias.name}"


EDGES: List[Tuple[str, str, int, str]] = [(module, target, line, text) for _, module, tree in SOURCES
                                          for target, line, text in _edges(module, tree) if target != module]


def _unit(module: str) -> str:
    """``deepcompile.zero.stage3`` -> ``zero``; the front ``deepcompile`` -> ""."""
    return module.split(".")[1] if "." in module else ""


def _where(module: str, line: int) -> str:
    return f"deepcompile/{FILE_OF[module]}:{line}"


# ---- the rules ----------------------------------------------------------------------------------


def test_every_unit_has_a_row():
    units = {_unit(m) for m in FILE_OF} - {""}
    missing = sorted(units - set(LAYERS))
    assert not missing, f"units without a row in LAYERS (tests/project/test_dependencies.py): {missing}; say what they may import"


def test_the_table_is_a_layering():
    """Rows name only units that have a row, and no unit reaches itself through the rows."""
    def units_of(row):
        return {entry.split(".")[0] for entry in row} - {"_C"}

    unknown = sorted((unit, u) for unit, row in LAYERS.items() for u in units_of(row) if u not in LAYERS)
    assert not unknown, f"rows name units that have no row: {unknown}"
    cycle = _find_cycle({unit: units_of(row) for unit, row in LAYERS.items()})
    assert not cycle, "LAYERS has a circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("unit", sorted(LAYERS))
def test_each_unit_imports_only_what_its_row_allows(unit):
    allowed = LAYERS[unit]
    offenders = []
    for module, target, line, text in EDGES:
        if _unit(module) != unit or _unit(target) == unit:
            continue
        relative = target[len("deepcompile."):]
        if not any(relative == a or relative.startswith(a + ".") for a in allowed):
            offenders.append(f"{_where(module, line)}: `{text}` ({unit} -> {_unit(target) or 'deepcompile'})")
    assert not offenders, (f"{unit} may import only {list(allowed) or 'nothing of the package'} "
                           "(tests/project/test_dependencies.py, LAYERS):\n  " + "\n  ".join(offenders))


def test_nothing_inside_imports_the_package_front():
    offenders = [f"{_where(module, line)}: `{text}`" for module, target, line, text in EDGES
                 if target == "deepcompile" and module != "deepcompile"]
    assert not offenders, ("deepcompile/__init__.py is the public front; import the defining module instead:\n  "
                           + "\n  ".join(offenders))


def _find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One circle of ``graph`` as [a, b, ..., a], or [] if it has none (iterative depth-first)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return []


def test_no_import_circle():
    graph: Dict[str, Set[str]] = {}
    first: Dict[Tuple[str, str], str] = {}
    for module, target, line, text in EDGES:
        if target != EXTENSION:
            graph.setdefault(module, set()).add(target)
            first.setdefault((module, target), f"{_where(module, line)}: `{text}`")
    cycle = _find_cycle(graph)
    assert not cycle, "import circle:\n  " + "\n  ".join(first[a, b] for a, b in zip(cycle, cycle[1:]))


def test_checkpoint_does_not_write_into_the_engine():
    """It returns what a load restores (the step counters); the engine assigns it."""
    offenders = []
    for rel, module, tree in SOURCES:
        if _unit(module) != "checkpoint":
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "engine":
                    offenders.append(f"deepcompile/{rel}:{node.lineno}: engine.{t.attr} = ...")
    assert not offenders, offenders


def _module_level_imports(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """Imports that run when the module is imported (not those inside functions)."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        todo.extend(ast.iter_child_nodes(node))


def test_config_is_data():
    """Reading a config loads neither torch nor the C++ extension (nor, through the runtime, both)."""
    offenders = [f"deepcompile/{rel}:{line}: {name}" for rel, module, tree in SOURCES if _unit(module) == "config"
                 for line, name in _module_level_imports(tree)
                 if name.split(".")[0] in ("torch", "functorch") or _containing_module(name) in (EXTENSION,
                                                                                                 "deepcompile.runtime")]
    assert not offenders, f"config modules import at load time: {offenders}"


# ---- torch ----------------------------------------------------------------------------------------


def _imported_names(tree: ast.AST) -> List[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _private_torch(name: str) -> bool:
    parts = name.split(".")
    if parts[:2] == ["torch", "ops"]:
        return False  # operator names (aten._to_copy) are the IR, not private Python surface
    return (parts[0] == "functorch"
            or (parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])))


def test_private_torch_only_in_compat():
    offenders = []
    for path, _, tree in SOURCES:
        if path.startswith("compat/"):
            continue
        names = _imported_names(tree) + [dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
        offenders += [(path, name) for name in names if _private_torch(name)]
    assert not offenders, f"private torch used outside deepcompile/compat/: {sorted(set(offenders))}"
