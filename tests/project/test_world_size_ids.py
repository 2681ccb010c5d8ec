"""Tests that launch processes (torchrun, accelerate's launcher, the fault and multi-node workers)
show their world size in their ids, like those that run bodies through run_distributed
(conftest.py enforces it there, seeing the sizes those bodies ran at; it cannot see inside a
launched process, so this test reads the sources instead; issue 39, item 8).

A test launches when its function, or a module-level function, class or fixture it names
(transitively), contains a launch (LAUNCHES). It must then carry ``pytest.mark.world_size(n)``
(its own, or the module's ``pytestmark``), or name its sizes itself (``dist_world_size``, a
``world`` parameter, ``ids=multiproc.ws_id``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

from _harness.paths import TESTS

# Source text that starts processes of a distributed run.
LAUNCHES = re.compile(r"torch\.distributed\.run|hf_launch\.torchrun\(|run_trl_worker\(|accelerate_launch|"
                      r"TwoNodeJob\(|_harness\.fault_worker|bench\.main\(\[[^\]]*--nproc")


def _marks_world_size(decorators: List[ast.expr]) -> bool:
    return any("world_size" in ast.unparse(d) or "ws_id" in ast.unparse(d) for d in decorators)


def _module_marked(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            if "world_size" in ast.unparse(node.value):
                return True
    return False


def _definitions(tree: ast.Module) -> Dict[str, ast.AST]:
    """Module-level functions and classes (also those defined under a module-level ``if``)."""
    found: Dict[str, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.col_offset <= 4:
            found.setdefault(node.name, node)
    return found


def _launches(node: ast.AST, defs: Dict[str, ast.AST], seen: Set[str]) -> bool:
    if LAUNCHES.search(ast.unparse(node)):
        return True
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names |= {a.arg for a in node.args.args}  # fixtures
    for name in sorted(names - seen):
        if name in defs:
            seen.add(name)
            if _launches(defs[name], defs, seen):
                return True
    return False


def unmarked_launching_tests(root: Path = TESTS) -> List[str]:
    missing = []
    for path in sorted(root.rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("_harness/") or path.resolve() == Path(__file__).resolve():
            continue  # this file's own example launches nothing
        tree = ast.parse(path.read_text())
        module_marked = _module_marked(tree)
        defs = _definitions(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")):
                continue
            if module_marked or _marks_world_size(node.decorator_list):
                continue
            if {"dist_world_size", "world"} & {a.arg for a in node.args.args}:
                continue
            if _launches(node, defs, {node.name}):
                missing.append(f"{rel}::{node.name}")
    return missing


def test_every_launching_test_shows_its_world_size():
    missing = unmarked_launching_tests()
    assert not missing, ("these tests launch distributed processes but their ids carry no world size: mark them "
                         "pytest.mark.world_size(n) with the launched world size:\n  " + "\n  ".join(missing))


def test_the_reader_sees_launches_through_fixtures_and_helpers(tmp_path):
    (tmp_path / "area").mkdir()
    (tmp_path / "area" / "test_x.py").write_text(
        "import pytest\n"
        "def _go():\n    hf_launch.torchrun(W, [], nproc=2)\n"
        "@pytest.fixture\ndef runs():\n    _go()\n"
        "def test_through_a_fixture(runs):\n    pass\n"
        "@pytest.mark.world_size(2)\ndef test_marked(runs):\n    pass\n"
        "def test_nothing_launched():\n    assert parse(['--nproc', '2'])\n")
    assert unmarked_launching_tests(tmp_path) == ["area/test_x.py::test_through_a_fixture"]
