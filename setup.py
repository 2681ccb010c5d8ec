"""Build of deepcompile._C: the C++ runtime and the torch.ops.dc op library.

The CUDA/NCCL path is compiled whenever the CUDA toolkit and NCCL headers are found (always in
CI, so CUDA code never breaks unseen); it is only *run* on GPU machines. No .cu files are needed:
device work goes through ATen and NCCL calls, so g++ compiles everything.
"""

import glob
import os
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def find_nccl():
    """(include_dir, lib_dir, lib_file) of NCCL, or None. Prefers NCCL_HOME, then the CUDA
    toolkit, then the nvidia-nccl wheel that torch itself loads."""
    candidates = []
    if os.environ.get("NCCL_HOME"):
        candidates.append((os.path.join(os.environ["NCCL_HOME"], "include"), os.path.join(os.environ["NCCL_HOME"], "lib")))
    if CUDA_HOME:
        candidates.append((os.path.join(CUDA_HOME, "include"), os.path.join(CUDA_HOME, "lib64")))
    try:
        import nvidia.nccl  # noqa: F401

        base = list(nvidia.nccl.__path__)[0]
        candidates.append((os.path.join(base, "include"), os.path.join(base, "lib")))
    except ImportError:
        pass
    for inc, lib in candidates:
        if not os.path.exists(os.path.join(inc, "nccl.h")):
            continue
        for name in ("libnccl.so", "libnccl.so.2"):
            if os.path.exists(os.path.join(lib, name)):
                return inc, lib, name
    return None


# The runtime core, the op library and the gloo communicator are one translation unit
# (csrc/runtime_unity.cpp includes their sources): each source costs far more in ATen headers than
# in its own code, and CI builds on 2 cores. The pybind11 bindings stay a unit of their own, so
# that the two largest units compile side by side. A new csrc/*.cpp must be added to the unity file.
core_sources = ["csrc/runtime_unity.cpp", "csrc/bindings.cpp"]
_unity = open(os.path.join(ROOT, "csrc", "runtime_unity.cpp")).read()
_missing = [
    f
    for f in sorted(glob.glob("csrc/*.cpp")) + ["csrc/comm/process_group.cpp"]
    if f not in core_sources and f'#include "{os.path.relpath(f, "csrc")}"' not in _unity
]
if _missing:
    sys.exit(f"deepcompile: {', '.join(_missing)} not compiled: add to csrc/runtime_unity.cpp")
include_dirs = [os.path.join(ROOT, "csrc", "include")]
# No -std flag: BuildExtension adds the C++ standard torch's headers need (C++20 in 2.12; torch
# 2.15's headers refuse anything older, so a pinned -std=c++17 broke the build there).
cxx_flags = ["-O2", "-Wall", "-Wno-unused-function"]

nccl = find_nccl() if CUDA_HOME and os.environ.get("DC_DISABLE_CUDA") != "1" else None
if nccl is not None:
    inc, lib, name = nccl
    extension = CUDAExtension(
        "deepcompile._C",
        core_sources + ["csrc/comm/nccl.cpp", "csrc/cuda/pinned_host.cpp"],
        include_dirs=include_dirs + [inc],
        library_dirs=[lib],
        extra_link_args=[f"-l:{name}", f"-Wl,-rpath,{lib}"],
        define_macros=[("DC_WITH_NCCL", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": []},
    )
else:
    print("deepcompile: CUDA toolkit or NCCL not found; building the CPU (gloo) runtime only", file=sys.stderr)
    extension = CppExtension(
        "deepcompile._C", core_sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags}
    )

setup(
    name="deepcompile",
    packages=find_packages(include=["deepcompile", "deepcompile.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
