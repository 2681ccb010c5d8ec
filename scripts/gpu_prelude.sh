# Sourced by the GPU runs (scripts/gpu_*.sh and bench/results/recipes/*.sh; not run on its own):
# the repository root as working directory, $OUT for logs, the GPU machine's system compilers (its
# default g++ builds an extension that crashes: bench/results/gpu-runs.md, "GPU machine toolchain")
# and `gpu_build`, the incremental build of the extension into the installed package.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=${MAX_JOBS:-16}
# Hopper only (the machine's H100/H200). The machine's own list names arch-specific targets
# ("9.0a"), which DeepSpeed 0.19.8's op builder cannot parse (its DeepCompile row then fails).
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST_OVERRIDE:-9.0}

gpu_build() {  # build log in $OUT/build.log; on failure its tail, and the calling script exits
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
}

world_size_summary() {  # $1: a pytest log. Its count of tests that ran at world size 1 only (tests/conftest.py)
  # On one GPU most distributed suites run at one rank, where gathers, reduce-scatters and
  # averaging are identities: a GPU run says how much of it was that.
  grep -h "^world sizes:" "$1" || echo "world sizes: no distributed test ran (no summary in $1)"
}

gpu_environment() {  # the machine, the library versions and the source digest, also to $OUT/env.txt
  {
    date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    echo "source digest $(bash scripts/source_digest.sh)"
  } 2>&1 | tee "$OUT/env.txt"
}

gpu_install_deepspeed() {  # DeepSpeed from the carried .whl/ (scripts/fetch_deepspeed_wheels.sh); log in $OUT
  # DS_BUILD_OPS=0: no op compiled at install; DeepSpeed builds what a row uses (DeepCompile's op library,
  # its CPU Adam) just in time with the compilers above. --no-build-isolation: its setup.py reads the
  # installed torch (and the sdist has no pyproject.toml).
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --find-links .whl --no-build-isolation "deepspeed==${DS_VERSION:-0.19.8}" \
    > "$OUT/deepspeed-install.log" 2>&1 || { tail -30 "$OUT/deepspeed-install.log"; exit 1; }
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
  # Its DeepCompile op library is built on first use: build it now, so no row's first step pays for it.
  timeout 400 python3 -c "from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load()" \
    >> "$OUT/deepspeed-install.log" 2>&1 \
    || echo "DeepSpeed's DeepCompile op build failed (its rows will say why): $OUT/deepspeed-install.log"
}

gpu_install_hf_extras() {  # TRL and datasets from .whl/hf (scripts/fetch_deepspeed_wheels.sh), if carried
  # `python3 -m pip`: the image's bare `pip` may belong to another Python (it once installed TRL
  # where the tests could not import it).
  if ls .whl/hf/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps .whl/hf/*.whl > "$OUT/hf-extras-install.log" 2>&1 \
      || tail -5 "$OUT/hf-extras-install.log"
  fi
}
