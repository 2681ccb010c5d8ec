"""The config package is data (issue 28, items 3 and 4):

* every key it accepts is read by the code, or listed with its reason in ``deepcompile/config/inert.py``
  (accepted only with one value, only switched off, inert, or without effect for any value), so that
  no key is accepted and then silently ignored;
* importing it loads neither torch nor the C++ extension (checked in a fresh interpreter through
  ``sys.modules``, and statically on its import statements).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap
from typing import Dict, Iterable, List, Set

from deepcompile.config.inert import FIXED_VALUE, INERT, NO_EFFECT, OFF_ONLY, handled_without_effect
from deepcompile.config.root import accepted_keys

from _harness.paths import ROOT

PACKAGE = ROOT / "deepcompile"
CONFIG = PACKAGE / "config"
# Config modules that define and validate keys: a key named there is not thereby used. The other
# config modules (rules, auto, batch, runtime_settings) turn keys into behaviour and count as readers.
DEFINING = {"__init__", "errors", "validators", "schema", "inert", "features", "precision", "zero",
            "compile_section", "optim", "deepspeed_sections", "root"}


def _reader_files() -> List[pathlib.Path]:
    return [p for p in PACKAGE.rglob("*.py") if not (p.parent == CONFIG and p.stem in DEFINING)]


def _names_read(paths: Iterable[pathlib.Path]) -> Set[str]:
    """Attribute names read (``x.name``) and string keys looked up (``d["name"]``, ``d.get("name")``,
    ``getattr(x, "name")``) anywhere in ``paths``."""
    read: Set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                read.add(str(node.slice.value))
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[-1 if _is_getattr(node) else 0],
                                                                          ast.Constant):
                is_get = isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                if is_get:
                    read.add(str(node.args[0].value))
                elif _is_getattr(node) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    read.add(str(node.args[1].value))
    return read


def _is_getattr(node: ast.Call) -> bool:
    return isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")


def unread_keys(listed: Dict[str, str]) -> List[str]:
    """Accepted keys that no reader names and no table lists."""
    read = _names_read(_reader_files())
    return [k for k in accepted_keys() if k not in listed and k.rsplit(".", 1)[-1] not in read]


def test_every_accepted_key_is_read_or_listed_without_effect():
    assert unread_keys(handled_without_effect()) == [], (
        "these keys are accepted, read by no code and not listed in deepcompile/config/inert.py: implement them, "
        "refuse them, or list them with the reason they have no effect")


def test_the_check_catches_keys_read_by_nothing():
    # The three keys docs/config.md once called implemented while nothing read them: listed
    # now (accepted only with the value that describes the runtime); unlisted, the check names them.
    gone = ("compile.deepcompile", "compile.keep_int_input_tensors", "compile.keep_all_input_tensors")
    listed = {k: v for k, v in handled_without_effect().items() if k not in gone}
    assert unread_keys(listed) == sorted(gone)


def test_every_table_row_names_an_accepted_key_once():
    keys = set(accepted_keys())
    rows = [*FIXED_VALUE, *OFF_ONLY, *INERT, *NO_EFFECT]
    assert len(rows) == len(set(rows)), "a key listed in two tables"
    assert not set(rows) - keys, f"rows for keys the config does not accept: {sorted(set(rows) - keys)}"


# ---- no torch, no C++ extension


def _top_level_imports(tree: ast.Module) -> List[str]:
    """Modules imported when the module itself is imported (not inside functions)."""
    out: List[str] = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                out.append(node.module or "")
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return out


def test_config_modules_import_only_the_standard_library_and_each_other():
    bad = {}
    for path in sorted(CONFIG.glob("*.py")):
        imports = _top_level_imports(ast.parse(path.read_text()))
        outside = [m for m in imports if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"
                   and not (m == "deepcompile.config" or m.startswith("deepcompile.config."))]
        if outside:
            bad[path.name] = outside
    assert not bad, f"config modules importing outside the standard library and deepcompile.config: {bad}"


def test_importing_and_using_the_config_loads_neither_torch_nor_the_extension():
    # deepcompile/__init__.py loads the runtime (torch and the C++ extension); a stand-in package
    # object lets the config package be imported on its own, as any module of it imports it.
    script = textwrap.dedent(f"""
        import sys, types
        package = types.ModuleType("deepcompile")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["deepcompile"] = package
        import json
        import deepcompile.config as config
        d = json.load(open({str(ROOT / "tests" / "fixtures" / "ds_configs" / "llamafactory_ds_z3.json")!r}))
        d.update(gradient_clipping=1.0, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                 bf16={{"enabled": True}}, fp16={{"enabled": False}})
        c = config.Config.from_any(d).resolve(world_size=2)
        assert c.train_batch_size == 8 and c.zero_optimization.reduce_bucket_size == 500_000_000
        c.notices()
        config.Config.from_any(c.to_dict())
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "deepcompile._C")))
        print("LOADED", loaded)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout
