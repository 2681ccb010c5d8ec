"""deepcompile/ops.py is the one home of the package's custom operators.

* Every operator registered in the package's namespaces (``dc``, from csrc/ops.cpp, and ``dcact``)
  has a row in ``ops.REGISTRY``, with a wrapper and a fake kernel that answers under FakeTensor.
* No module other than ops.py reaches those namespaces raw (``torch.ops.dc``, ``getattr(torch.ops,
  ...)``, ``torch.library.Library``): graph passes use the overload constants, eager code the
  wrappers.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch

from deepcompile import ops

from _harness.source_names import dotted
from _harness.paths import ROOT

PACKAGE = os.path.join(ROOT, "deepcompile")
HOME = "ops.py"


def _raw_accesses(tree: ast.AST):
    """(line, what) for each raw reach into a custom-op namespace in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            parts = name.split(".")
            if parts[:2] == ["torch", "ops"] and len(parts) == 3 and parts[2] in ops.NAMESPACES:
                yield node.lineno, name
            elif name.startswith("torch.library.") and name.split(".")[2] in ("Library", "define", "impl",
                                                                              "register_fake", "custom_op"):
                yield node.lineno, name
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and dotted(node.args[0]) == "torch.ops"):
            yield node.lineno, "getattr(torch.ops, ...)"


def _package_sources():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PACKAGE).replace(os.sep, "/"), ast.parse(f.read(), path)


def test_only_ops_py_reaches_the_op_namespaces():
    offenders = [f"deepcompile/{rel}:{line}: {what}" for rel, tree in _package_sources() if rel != HOME
                 for line, what in _raw_accesses(tree)]
    assert not offenders, ("call the wrappers or use the overload constants of deepcompile/ops.py instead:\n  "
                           + "\n  ".join(offenders))


def test_the_raw_access_check_sees_each_form():
    source = ("import torch\nx = torch.ops.dc.reduce_grad.default\ny = getattr(torch.ops, 'dcact')\n"
              "z = torch.library.Library('dcact', 'IMPL')\nw = torch.ops.aten.mm.default\n")
    assert sorted(line for line, _ in _raw_accesses(ast.parse(source))) == [2, 3, 4]


def _registered_in_our_namespaces():
    prefixes = tuple(f"{ns}::" for ns in ops.NAMESPACES)
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefixes))


def test_every_registered_op_has_a_row():
    registered = _registered_in_our_namespaces()
    assert "dc::allgather_param.slot" in registered and "dcact::wait_reload" in registered
    listed = ops.registered_names()
    assert sorted(set(registered) - set(listed)) == [], "ops without a row in deepcompile/ops.py REGISTRY"
    assert sorted(set(listed) - set(registered)) == [], "rows of deepcompile/ops.py REGISTRY that are not registered"
    assert len(listed) == len(set(listed))


@pytest.mark.parametrize("entry", ops.REGISTRY, ids=lambda e: e.name)
def test_each_row_names_its_wrapper_overloads_and_fake(entry):
    namespace, name = entry.name.split("::")
    assert entry.wrapper.__name__ == name and entry.wrapper.__module__ == "deepcompile.ops"
    for overload_name, overload in entry.overloads.items():
        assert overload.namespace == namespace and overload._overloadname == overload_name
    assert entry.fake
    assert torch._C._dispatch_has_kernel_for_dispatch_key(entry.name, "Meta")


def test_wrappers_run_under_fake_tensors():
    """The fake kernels answer with the shapes the real ones return (the dc ones from C++)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 3)
        gathered = ops.allgather_param(x, 1, 7, torch.bfloat16)
        assert gathered.shape == (4, 3) and gathered.dtype == torch.bfloat16
        assert ops.wait_allgather(gathered, 1, 7).shape == (4, 3)
        assert ops.release_param(gathered, 1, 7, 1).shape == (4, 3)
        assert ops.reduce_grad(x, 1, 7).numel() == 0
        assert ops.end_backward([x], 1, False) is None
        assert ops.offload_activation(x, [], 1) is None
        assert ops.wait_reload(x, 1).shape == (4, 3)


def test_side_effectful_and_protected_ops_are_registry_overloads():
    overloads = {o for entry in ops.REGISTRY for o in entry.overloads.values()}
    assert set(ops.SIDE_EFFECTFUL) <= overloads
    assert ops.ALLGATHER_PARAM not in ops.SIDE_EFFECTFUL  # its result is what the graph reads
    assert {op for op, _, _ in ops.INDUCTOR_PROTECTED_BUFFERS} <= overloads
    assert set(ops.ALIASING) <= overloads
