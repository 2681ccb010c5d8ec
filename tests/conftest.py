"""pytest configuration shared by the Python test suite.

* Puts the repository root and this folder on ``sys.path`` (also for spawned ranks, which
  inherit the parent's ``sys.path``), so ``deepcompile`` and the shared helpers in ``_harness/``
  import without an install, wherever in the repository pytest is started. Test files in
  subfolders (``runtime/``) have no ``__init__.py``: pytest imports each by its base name with its
  folder on ``sys.path``, which the spawned ranks inherit too, so their bodies unpickle there.
* Registers the ``gpu`` marker: tests that need CUDA; they run only with ``DC_TEST_DEVICE=cuda``
  on a machine with GPUs and are skipped (with the reason) otherwise.
* ``dist_world_size``: module-scoped world size parameter (2 and 3 ranks, or the sizes listed in
  ``DC_TEST_WORLD_SIZES``, e.g. ``4`` on a 4-GPU machine). Being module-scoped, it
  makes pytest run all tests of one world size together, so one pool of rank processes serves
  them (see ``_harness/multiproc.py``). Under ``DC_TEST_DEVICE=cuda`` the sizes follow the GPUs
  present: sizes above the GPU count skip with the reason, and when no default size fits (one
  GPU) the suites run at one rank per GPU (``multiproc.world_sizes``).
"""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import pytest  # noqa: E402

from _harness import multiproc  # noqa: E402

WORLD_SIZES = multiproc.world_sizes(default=(2, 3))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs CUDA; runs only with DC_TEST_DEVICE=cuda on a machine with GPUs",
    )


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


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def dist_world_size(request):
    multiproc.require_world_size(request.param)
    return request.param
