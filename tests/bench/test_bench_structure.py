"""The bench's layout stays one that others can extend (issue 40 item 5): no module of bench/ over
500 lines, no import circle among bench/'s modules (lazy imports inside functions included), and
train_bench.py's parts (the rows table, the runner of each peer family, the shared core, measuring,
the report) never import the entry point nor each other's families. Read with ast: nothing is
imported or run."""

from __future__ import annotations

import ast
import os
from typing import Dict, Set

from _harness.paths import ROOT

BENCH = os.path.join(ROOT, "bench")
MAX_LINES = 500
# Files allowed over the limit (none today; bench/README.md, "How train_bench is built").
KNOWN_LONG: Set[str] = set()
# One runner module per peer family (train_rows.FAMILIES): each may import the shared core and
# layouts only, never another family, the rows table, the measuring or the entry point.
RUNNERS = ("run_deepcompile", "run_torch", "deepspeed_peer")
RUNNER_MAY_IMPORT = {"train_core", "layouts"}
# train_bench's parts: what they import (transitively) never includes train_bench.
PARTS = ("train_core", "train_rows", "train_options", "train_measure", "train_report", "row_process", "peer_rows",
         "layouts", "dist_setup", *RUNNERS)


def _modules() -> Dict[str, str]:
    return {name[:-3]: os.path.join(BENCH, name) for name in sorted(os.listdir(BENCH)) if name.endswith(".py")}


def _imports(path: str, local: Set[str]) -> Set[str]:
    """bench/ modules imported anywhere in ``path`` (module level or inside functions)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args \
                and isinstance(node.args[0], ast.Constant):
            out.add(str(node.args[0].value).split(".")[0])
    return out & local


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}


def _reach(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen: Set[str] = set()
    todo = list(graph[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def test_no_bench_module_is_over_500_lines():
    long = {}
    for name, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES and f"{name}.py" not in KNOWN_LONG:
            long[f"{name}.py"] = n
    assert not long, f"bench modules over {MAX_LINES} lines (split them by job): {long}"


def test_no_import_circle_among_bench_modules():
    graph = _graph()
    circles = sorted(m for m in graph if m in _reach(graph, m))
    assert not circles, f"bench modules that import themselves back: {circles} ({ {m: graph[m] for m in circles} })"


def test_train_bench_parts_never_import_the_entry_point():
    graph = _graph()
    for part in PARTS:
        assert part in graph, f"bench/{part}.py is gone: update PARTS (and bench/README.md)"
        assert "train_bench" not in _reach(graph, part), f"bench/{part}.py imports train_bench (directly or not)"


def test_each_runner_imports_only_the_shared_core():
    graph = _graph()
    for runner in RUNNERS:
        assert _reach(graph, runner) <= RUNNER_MAY_IMPORT, (runner, _reach(graph, runner) - RUNNER_MAY_IMPORT)


def test_the_rows_table_names_a_runner_module_per_family():
    import sys

    sys.path.insert(0, BENCH)
    import train_rows

    assert {m.family for m in train_rows.METHODS.values()} == set(train_rows.FAMILIES)
    assert {f.__module__ for f in train_rows.FAMILIES.values()} == set(RUNNERS)
    for key, m in train_rows.METHODS.items():
        assert m.key == key and (m.stage is not None) == (m.family == "deepcompile"), key
