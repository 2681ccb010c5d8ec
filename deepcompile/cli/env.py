"""``deepcompile env``: the environment report to paste into a bug report or read before a run.

Versions of Python, torch, CUDA and NCCL as torch sees them, the compilers torch.compile and the
extension use, the GPUs this process sees, and what deepcompile's runtime extension was built
with (the CUDA/NCCL path is compiled only when setup.py found the CUDA toolkit and NCCL headers;
without it only the CPU/gloo runtime exists).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="report torch, CUDA, NCCL, compilers, GPUs and how deepcompile was built",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(command="env")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _first_line(cmd: List[str], last: bool = False) -> str:
    exe = shutil.which(cmd[0])
    if exe is None:
        return "not found"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return f"{exe}: {e}"
    line = (out[-1] if last else out[0]) if out else "(no output)"
    return f"{line} ({exe})"


def _built_with_nccl() -> Tuple[Optional[bool], str]:
    """The extension's own answer, or for one built before it recorded it, whether its binary
    refers to NCCL's communicator calls."""
    from deepcompile import _C, runtime

    flag = runtime.built_with_nccl()
    if flag is not None:
        return flag, ""
    try:
        with open(_C.__file__, "rb") as f:
            linked = b"ncclCommInitRank" in f.read()
    except OSError:
        return None, "unknown"
    return linked, " (from the extension's symbols; rebuild for its own answer)"


def collect() -> List[Tuple[str, str]]:
    import torch
    import torch.distributed as dist

    rows: List[Tuple[str, str]] = []
    rows.append(("deepcompile", f"{_version('deepcompile')} at {os.path.dirname(os.path.dirname(__file__))}"))
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", platform.platform()))
    rows.append(("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'}, git {torch.version.git_version[:10]})"))
    cuda = torch.cuda.is_available()
    rows.append(("CUDA available", f"{cuda}" + (f", driver-visible devices {torch.cuda.device_count()}" if cuda else "")))
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else "none (CPU build of torch)"
    except Exception as e:  # noqa: BLE001  (a torch without NCCL raises its own errors)
        nccl = f"unavailable ({type(e).__name__})"
    rows.append(("NCCL (torch)", nccl))
    rows.append(("distributed backends", ", ".join(b for b, ok in (("gloo", dist.is_gloo_available()),
                                                                   ("nccl", dist.is_nccl_available())) if ok) or "none"))
    try:
        flag, how = _built_with_nccl()
        built = {True: "yes", False: "no (CPU/gloo runtime only)", None: "unknown"}[flag] + how
    except Exception as e:  # noqa: BLE001  (an extension that fails to load is what to report)
        built = f"the extension failed to load: {type(e).__name__}: {e}"
    rows.append(("deepcompile NCCL path compiled", built))
    rows.append(("C++ compiler", _first_line([os.environ.get("CXX", "c++"), "--version"])))
    rows.append(("nvcc", _first_line(["nvcc", "--version"], last=True)))
    rows.append(("triton", _version("triton")))
    # The Hugging Face stack the served DeepSpeed interface is used through (docs/huggingface.md).
    for package in ("transformers", "accelerate", "peft", "trl", "safetensors"):
        rows.append((package, _version(package)))
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability "
                                     f"{p.major}.{p.minor}"))
    else:
        rows.append(("GPUs", "none seen (CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "unset") + ")"))
    return rows


def run(args) -> int:
    rows = collect()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
