#!/usr/bin/env bash
# Installs everything deepcompile needs on a fresh machine, then builds and installs the package
# (editable). torch comes from the package registry: 2.12.x, a CUDA 13.0 build that matches the
# CUDA 13.0 toolkit used to compile the NCCL path. A machine that already has torch >= 2.11 (the
# GPU machine ships 2.11.0+cu130) keeps its torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
then
  "$PY" -m pip install --progress-bar off "torch==2.12.*"
fi
"$PY" -m pip install --progress-bar off -r requirements-dev.txt
# --no-build-isolation: compile against the torch installed above, not a fresh copy of it.
"$PY" -m pip install --progress-bar off --no-build-isolation --no-deps -e .
"$PY" -c "import deepcompile, torch; print('deepcompile installed; torch', torch.__version__)"

# Where the CUDA toolkit is present (CI included), the CUDA/NCCL path must have been compiled:
# never let a silent CPU-only build hide broken CUDA code.
if command -v nvcc >/dev/null 2>&1; then
  so=$("$PY" -c "import deepcompile._C as c; print(c.__file__)")
  if ! nm -D --undefined-only "$so" | grep -q ncclCommInitRank; then
    echo "setup: the CUDA toolkit is here but deepcompile._C was built without NCCL" >&2
    exit 1
  fi
  echo "deepcompile: CUDA/NCCL path compiled"
fi
