#!/usr/bin/env bash
# CPU parity smoke test on the newest torch the package registry serves, when that differs from
# the torch installed here (CI stays on 2.12.x; this catches private-API moves early).
#
# The newest torch goes into a venv of its own (build/newest-torch-venv, ignored by git) with only
# what the smoke needs, so the installed torch is never touched. deepcompile is built
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

# What the smoke needs and no more: torch and the libraries it loads at import (the registry's
# default wheel is a CUDA build, and it imports and runs on CPU-only machines), the build tools,
# pytest, and transformers for the Llama and Qwen2-MoE tests. Triton is left out: Inductor
# generates C++ on CPU, and triton is a gigabyte.
SMOKE_REQUIREMENTS=("torch==$newest" "setuptools>=64" wheel ninja pytest numpy "transformers>=5.17")
LEFT_OUT=(triton)
# The install peaks at what is installed plus the largest wheel being unpacked (about 5.5 GB
# for torch 2.15). CI machines have little disk left after the full suite, so check first.
MIN_FREE_GB=${DC_NEWEST_TORCH_MIN_FREE_GB:-6}

venv_ready() { [ -f "$VENV/.smoke-torch" ] && [ "$(cat "$VENV/.smoke-torch")" = "$newest" ]; }
if ! venv_ready; then
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  free_gb=$(df --output=avail -BG "$(dirname "$VENV")" | tail -n 1 | tr -dc 0-9)
  echo "newest-torch smoke: ${free_gb} GB free where the venv goes ($(dirname "$VENV"))"
  if [ "$free_gb" -lt "$MIN_FREE_GB" ]; then
    echo "newest-torch smoke: NOT RUN: installing torch $newest needs about $MIN_FREE_GB GB free," \
         "this machine has $free_gb GB. Torch $newest is untested here; run this script where" \
         "there is room (DC_NEWEST_TORCH_MIN_FREE_GB lowers the threshold)." >&2
    exit 0
  fi
  "$PY" -m venv "$VENV"
  # One resolve for everything, then one package per pip call for the big ones, so that at most
  # one large wheel sits downloaded beside the installed packages at a time.
  "$VENV/bin/python" -m pip install --progress-bar off -q --dry-run --ignore-installed \
      --report "$VENV/resolve.json" "${SMOKE_REQUIREMENTS[@]}"
  mapfile -t PINS < <("$VENV/bin/python" - "$VENV/resolve.json" "${LEFT_OUT[@]}" <<'PYEOF'
import json, sys
report, left_out = sys.argv[1], {name.lower() for name in sys.argv[2:]}
for item in json.load(open(report))["install"]:
    name = item["metadata"]["name"]
    if name.lower() not in left_out:
        print(f"{name}=={item['metadata']['version']}")
PYEOF
  )
  small=()
  for pin in "${PINS[@]}"; do
    case "${pin,,}" in
      torch==*|nvidia-*|cuda-*) "$VENV/bin/python" -m pip install --progress-bar off --no-cache-dir -q --no-deps "$pin" ;;
      *) small+=("$pin") ;;
    esac
  done
  "$VENV/bin/python" -m pip install --progress-bar off --no-cache-dir -q --no-deps "${small[@]}"
  echo "$newest" > "$VENV/.smoke-torch"
  echo "newest-torch smoke: venv holds $(du -sh "$VENV" | cut -f1)"
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
