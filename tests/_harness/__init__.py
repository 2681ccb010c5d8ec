"""Helpers shared by the test files; no tests live here.

* ``multiproc``: runs a test body on N ranks that share a process group (gloo on CPU, NCCL with
  ``DC_TEST_DEVICE=cuda``) and picks the world sizes the device can host;
* ``parity_cases`` / ``parity_extra``: small models, data and the single-process reference
  training that the parity tests compare the engine against;
* ``offload_gpu``: the training run and readings the GPU offload tests share;
* ``runtime_reference``: seeded parameters and gradients, the ZeRO layouts and the checks shared by
  the op tests in ``tests/runtime/``;
* ``paths``: the repository's root and ``tests/``, for tests that read its files or run its scripts.

Imported as ``_harness.<module>``: ``tests/conftest.py`` puts ``tests/`` on ``sys.path``, and the
spawned rank processes inherit that path, so they unpickle the test bodies by the same names.
"""
