"""Probes that run in a child process where ``deepcompile.serve_as_deepspeed()`` took over
``deepspeed`` (it rewrites ``sys.modules``, so never in pytest's own process).

A test file names its probes (module-level functions) in a list; ``run_in_served_child`` runs that
file's ``run_probes`` in a child, each probe caught on its own (one failing import must not hide
the others), and returns ``{probe: None | traceback}``; ``check`` fails a test on its probe's
traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from _harness import hf_launch

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import importlib.util, json, sys
sys.path.insert(0, {tests!r})  # the test file imports _harness
import deepcompile
deepcompile.serve_as_deepspeed()
spec = importlib.util.spec_from_file_location({module!r}, {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from _harness.served_probes import run_probes
run_probes(vars(module), module._PROBES, {out!r})
"""


def run_probes(namespace: Mapping[str, Any], names: Sequence[str], out_path: str) -> None:
    """In the served child: each probe of ``names`` (functions of ``namespace``), caught on its own;
    ``{probe: null | traceback}`` written to ``out_path``."""
    results: Dict[str, Optional[str]] = {}
    for name in names:
        probe: Callable[[], Any] = namespace[name]
        try:
            probe()
            results[name] = None
        except BaseException:  # noqa: BLE001 - reported to the test that owns the probe
            results[name] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(results, f)


def run_in_served_child(test_file: str, module_name: str, out_path: str, env: Optional[Dict[str, str]] = None,
                        timeout: float = 300) -> Dict[str, Optional[str]]:
    """Run ``test_file``'s probes (its ``_PROBES`` list) in a served child; their outcomes."""
    code = _CHILD.format(tests=_TESTS, module=module_name, path=os.path.abspath(test_file), out=out_path)
    proc = subprocess.run([sys.executable, "-c", code], env=hf_launch.launch_env(env or {}), cwd=hf_launch.ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    with open(out_path) as f:
        return json.load(f)


def check(outcomes: Mapping[str, Optional[str]], probe: str) -> None:
    error = outcomes[probe]
    assert error is None, f"{probe} failed in the served process:\n{error}"
