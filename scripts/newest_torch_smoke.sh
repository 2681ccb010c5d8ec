#!/usr/bin/env bash
# CPU parity smoke test on the newest torch the package registry serves, when that differs from
# the torch installed here (CI stays on 2.12.x; this catches private-API moves early).
#
# The newest torch goes into a venv of its own (build/newest-torch-venv, ignored by git) together
# with requirements-dev.txt, so the installed torch is never touched. deepcompile is built
# CPU-only (DC_DISABLE_CUDA=1: the CUDA toolkit here need not match that torch's CUDA) from a
# copy of the sources in build/newest-torch-src, so the in-place build of the main checkout keeps
# its extension compiled against the installed torch. A re-run reuses the venv (if its torch is
# still the newest) and recompiles only what changed.
#
# Environment: PYTHON (the interpreter whose torch is "installed", default python3);
# DC_NEWEST_TORCH (a version to test instead of asking the registry, e.g. 2.15.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=$PWD/build/newest-torch-venv
SRC=$PWD/build/newest-torch-src
START=$SECONDS

# The smoke test (about 40 tests): the compat helpers and the op library; the ZeRO-3 graph pass;
# the backend and partitioner end to end on Inductor and eager for ZeRO-3 (the eager fallback of a
# frame Dynamo skips, a graph break, a transformers Llama), ZeRO-2 (eager; Inductor on transformers'
# Qwen2-MoE) and ZeRO-1 (Inductor, bf16, accumulation); the profile-guided ZeRO-3 schedule.
TESTS=(
  tests/compat/test_compat.py
  tests/runtime/test_op_schemas.py
  tests/compiler/test_zero3_pass.py
  "tests/parity/test_zero3_parity.py::test_zero3_parity[ws2-mlp-inductor-False]"
  "tests/parity/test_zero3_parity.py::test_zero3_parity[ws2-llama-eager-False]"
  "tests/parity/test_zero3_parity.py::test_zero3_parity[ws2-disabled_forward-eager-True]"
  "tests/parity/test_zero3_parity.py::test_zero3_parity[ws2-graph_break-eager-False]"
  "tests/parity/test_zero12_parity.py::test_zero12_parity[ws2-mlp-eager-2]"
  "tests/parity/test_zero12_parity.py::test_zero12_qwen2_moe_inductor[ws2-2]"
  tests/parity/test_zero12_parity.py::test_zero1_bf16_accumulation_inductor
  "tests/scheduling/test_scheduling.py::test_parity_with_prefetch_and_selective_gather[ws2-mlp-inductor-1-False]"
)

installed=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")

# The newest final release of torch the registry serves for this interpreter. `pip index
# versions` is marked experimental, so if it fails the list is read from the error pip prints for
# an unsatisfiable requirement ("... (from versions: 1.13.0, ...)"), which downloads nothing.
newest_from_registry() {
  { "$PY" -m pip index versions torch 2>/dev/null || true
    "$PY" -m pip download --no-deps --dest "${TMPDIR:-/tmp}" "torch==0.0.0.dev0" 2>&1 || true
  } | "$PY" -c '
import re, sys
text = sys.stdin.read()
found = re.findall(r"Available versions:\s*([^\n]+)", text) + re.findall(r"\(from versions:\s*([^)]*)\)", text)
versions = {v.strip() for line in found for v in line.split(",")}
final = [v for v in versions if re.fullmatch(r"\d+(\.\d+)*", v)]  # no pre/dev/post releases
if final:
    print(max(final, key=lambda v: tuple(int(x) for x in v.split("."))))
'
}

newest=${DC_NEWEST_TORCH:-$(newest_from_registry)}
if [ -z "$newest" ]; then
  echo "newest-torch smoke: could not read torch's versions from the package registry" >&2
  exit 1
fi
echo "newest-torch smoke: installed torch $installed, newest on the registry $newest"
if [ "$newest" = "$installed" ]; then
  echo "newest-torch smoke: the installed torch is the newest; nothing more to test"
  exit 0
fi

venv_torch() { "$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true; }
if [ "$(venv_torch)" != "$newest" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # One resolve for torch and the test requirements, so they agree. The registry's default
  # wheel is a CUDA build; it imports and runs on CPU-only machines.
  "$VENV/bin/python" -m pip install --progress-bar off --no-cache-dir -q "torch==$newest" -r requirements-dev.txt
fi
echo "newest-torch smoke: venv ready ($((SECONDS - START)) s)"

# A copy of the sources (mtimes kept, so ninja rebuilds only what changed since the last run).
mkdir -p "$SRC"
rm -rf "$SRC/deepcompile" "$SRC/csrc" "$SRC/tests"
cp -a deepcompile csrc tests setup.py pyproject.toml "$SRC/"
find "$SRC/deepcompile" "$SRC/tests" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
if ! (cd "$SRC" && DC_DISABLE_CUDA=1 "$VENV/bin/python" setup.py -q build_ext --inplace) >"$SRC/build.log" 2>&1; then
  tail -n 80 "$SRC/build.log" >&2
  echo "newest-torch smoke: building deepcompile against torch $newest failed (log: $SRC/build.log)" >&2
  exit 1
fi
echo "newest-torch smoke: deepcompile built CPU-only ($((SECONDS - START)) s)"

cd "$SRC"
"$VENV/bin/python" -c "import torch, deepcompile; print('newest-torch smoke: running on torch', torch.__version__, 'from', torch.__file__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
echo "newest-torch smoke: passed on torch $newest ($((SECONDS - START)) s)"
