"""pytest configuration shared by the Python test suite.

* Puts the repository root and this folder on ``sys.path`` (also for spawned ranks, which
  inherit the parent's ``sys.path``), so ``deepcompile`` and the shared helpers in ``_harness/``
  import without an install, wherever in the repository pytest is started. Test files live in
  one folder per package area (``zero/``, ``offload/``, ...; README.md here) without
  ``__init__.py``: pytest imports each by its base name, so base names are unique across folders.
  Every area folder goes on ``sys.path`` too, before collection: a test file may import another's
  tolerances or models by base name (``from test_zero3_parity import FP32_TOL``) whichever is
  collected first, and the spawned ranks inherit the path, so their bodies unpickle there.
* Registers the ``gpu`` marker: tests that need CUDA; they run only with ``DC_TEST_DEVICE=cuda``
  on a machine with GPUs and are skipped (with the reason) otherwise.
* ``dist_world_size``: module-scoped world size parameter (2 and 3 ranks, or the sizes listed in
  ``DC_TEST_WORLD_SIZES``, e.g. ``4`` on a 4-GPU machine). Being module-scoped, it
  makes pytest run all tests of one world size together, so one pool of rank processes serves
  them (see ``_harness/multiproc.py``). Under ``DC_TEST_DEVICE=cuda`` the sizes follow the GPUs
  present: sizes above the GPU count skip with the reason, and when no default size fits (one
  GPU) the suites run at one rank per GPU (``multiproc.world_sizes``).
* World sizes in test ids: every test that runs distributed bodies shows the world size of each
  in its id (``ws2``), so a run at one rank (one GPU), where gathers, reduce-scatters and
  averaging are identities, is visible as such. ``dist_world_size`` and parameters given
  ``ids=multiproc.ws_id`` put it there; a test at one fixed size says it with
  ``pytest.mark.world_size(n)`` (on the test, or ``pytestmark`` for a module), which adds
  ``ws<n>`` to its id unless the test's own parameters name its sizes. A test whose bodies ran at a size its id does not show fails. At the end
  the summary counts the tests that ran at world size 1 only (``world sizes: ...``).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Dict, List

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
# The area folders: appended, so a test file's base name never shadows anything else.
for _entry in sorted(os.scandir(_TESTS), key=lambda e: e.name):
    if _entry.is_dir() and _entry.name not in ("_harness", "cpp", "fixtures", "__pycache__") and (
            _entry.path not in sys.path):
        sys.path.append(_entry.path)

import pytest  # noqa: E402

from _harness import multiproc  # noqa: E402

WORLD_SIZES = multiproc.world_sizes(default=(2, 3))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs CUDA; runs only with DC_TEST_DEVICE=cuda on a machine with GPUs",
    )
    config.addinivalue_line(
        "markers",
        "world_size(n, ...): the test's distributed bodies run at world size n (or at each size given); its id "
        "shows ws<n>",
    )
    config.addinivalue_line("markers", "slow: long-running (e.g. the full model zoo); deselect with -m 'not slow'")


def _names_world_sizes_itself(metafunc) -> bool:
    """The test's own parameters name its world sizes: ``dist_world_size``, a ``world``
    parameter, or parametrize ids that hold ``ws<n>`` (a module-wide mark must not add another)."""
    if "dist_world_size" in metafunc.fixturenames or "world" in metafunc.fixturenames:
        return True
    for mark in metafunc.definition.iter_markers("parametrize"):
        ids = mark.kwargs.get("ids")
        if ids is multiproc.ws_id or (isinstance(ids, (list, tuple)) and any(
                isinstance(i, str) and re.search(r"(?:^|-)ws\d+(?=-|$)", i) for i in ids)):
            return True
    return False


def pytest_generate_tests(metafunc):
    mark = metafunc.definition.get_closest_marker("world_size")
    if mark is None or _names_world_sizes_itself(metafunc):
        return
    sizes = mark.args  # a test may run bodies at several sizes (a checkpoint saved at 2, loaded at 3)
    metafunc.parametrize("world_size_id", [sizes[0] if len(sizes) == 1 else sizes],
                         ids=["-".join(multiproc.ws_id(n) for n in sizes)])


@pytest.fixture(autouse=True)
def world_size_id(request):
    """The world size (or sizes) a ``world_size`` mark put in this test's id (None: no mark). Autouse so
    that conftest can parametrize it for any test (pytest parametrizes only fixtures a test
    uses)."""
    return getattr(request, "param", None)


# Test id -> the world sizes its distributed bodies ran at, for the summary.
_RAN_AT: Dict[str, List[int]] = {}


def _shown_world_sizes(item) -> List[int]:
    callspec = getattr(item, "callspec", None)
    return [int(n) for n in re.findall(r"(?:^|-)ws(\d+)(?=-|$)", callspec.id)] if callspec else []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    multiproc.ran_world_sizes.clear()
    try:
        result = yield
    finally:
        ran = sorted(set(multiproc.ran_world_sizes))
        if ran:
            _RAN_AT[item.nodeid] = ran
            item.user_properties.append(("world_sizes", ",".join(map(str, ran))))
    hidden = [n for n in ran if n not in _shown_world_sizes(item)]
    if hidden:
        raise AssertionError(
            f"{item.nodeid} ran distributed bodies at world size {hidden} but its id does not say so: mark the "
            f"test pytest.mark.world_size(n), use dist_world_size, or parametrize with ids=multiproc.ws_id")
    return result


def pytest_terminal_summary(terminalreporter):
    if not _RAN_AT:
        return
    only_one = [nodeid for nodeid, sizes in _RAN_AT.items() if sizes == [1]]
    terminalreporter.write_line(
        f"world sizes: {len(_RAN_AT)} tests ran distributed bodies, {len(only_one)} of them at world size 1 only "
        "(gathers, reduce-scatters and averaging are identities there; their ids say ws1)")


def pytest_collection_modifyitems(config, items):
    on_gpu = multiproc.test_device_type() == "cuda"
    if on_gpu:
        import torch

        on_gpu = torch.cuda.is_available()
    if on_gpu:
        return
    skip = pytest.mark.skip(reason="gpu test: set DC_TEST_DEVICE=cuda on a machine with GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    multiproc.shutdown_pools()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=multiproc.ws_id)
def dist_world_size(request):
    multiproc.require_world_size(request.param)
    return request.param
