"""The one patch of another library's internals: accelerate's DeepSpeed path on a CPU machine.

accelerate picks its process-group backend in ``PartialState._prepare_backend`` from the
accelerators present; with ``ACCELERATE_USE_DEEPSPEED`` and no GPU it finds none, and then counts
the run as a single process (``num_processes == 1`` on every rank) although the launcher started
several. Here that case gets gloo, so ``deepspeed.comm.init_distributed`` joins the launcher's
ranks and accelerate counts them. Nothing changes where accelerate found a backend (GPUs), for
``cpu=True`` runs (accelerate's own MULTI_CPU path), or without DeepSpeed.

Kept to one function, checked against the accelerate versions it was read from, so a release
that moves it fails here with a message instead of silently training one rank.
"""

from __future__ import annotations

import functools
import os

# accelerate releases whose PartialState._prepare_backend(cpu, sagemaker_dp, backend) this was
# written against (1.15 on the GPU machine; read in accelerate's source).
TESTED_MAJOR = 1


def _wanted(cpu: bool) -> bool:
    return (not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")


def install() -> None:
    """Patch accelerate (once) when this process has no GPU; a no-op otherwise."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        import accelerate
        from accelerate.state import PartialState
    except ImportError:
        return  # no accelerate: nothing to adapt
    original = PartialState._prepare_backend
    if getattr(original, "_deepcompile_cpu", False):
        return
    major = int(accelerate.__version__.split(".")[0])
    if major != TESTED_MAJOR:
        raise RuntimeError(
            f"deepcompile.serve_as_deepspeed: accelerate {accelerate.__version__} is not a version whose CPU backend "
            f"selection this was checked against (major version {TESTED_MAJOR}); on CPU use a 1.x release")

    @functools.wraps(original)
    def prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and _wanted(cpu):
            return "gloo", distributed_type
        return chosen, distributed_type

    prepare_backend._deepcompile_cpu = True
    PartialState._prepare_backend = prepare_backend
