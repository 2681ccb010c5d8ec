#!/usr/bin/env bash
# Runs every test: the GoogleTest suite of the C++ core (built with CMake against the installed
# torch) and the pytest suite (op schemas, multi-process gloo tests on CPU; GPU tests run only
# where CUDA is present).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_ROOT=$("$PY" -c "import os, torch; print(os.path.dirname(torch.__file__))")

cmake -S . -B build/cpp -G Ninja -DTORCH_ROOT="$TORCH_ROOT" >/dev/null
cmake --build build/cpp -j "$(nproc)"
ctest --test-dir build/cpp --output-on-failure

# Tests marked slow (the whole model zoo, 4-rank variants) are run by hand before an issue that
# needs them is resolved: DC_TEST_SLOW=1 includes them.
slow=(-m "not slow")
if [ "${DC_TEST_SLOW:-0}" = 1 ]; then slow=(); fi
"$PY" -m pytest -q --durations=25 "${slow[@]}" tests "$@"
