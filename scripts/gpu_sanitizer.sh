#!/usr/bin/env bash
# compute-sanitizer (memcheck) over the README's main job on 2 GPUs (SANITIZER_NPROC): a few
# ZeRO-3 steps of the small Llama in examples/train_llama.py, eager backend, NCCL, launched by
# torchrun, every process tracked. The CUDA caching allocator is switched off (PYTORCH_NO_CUDA_MEMORY_CACHING=1)
# so that each tensor is its own cudaMalloc and memcheck sees every out-of-bounds access and
# every access to freed memory.
#
#   bash scripts/gpu_sanitizer.sh          # after scripts/gpu_check.sh built the extension
#
# Environment: OUT (log folder, default ./gpu-logs), SANITIZER_STEPS (default 3), SANITIZER_NPROC
# (processes = GPUs, default 2; 1 on a one-GPU machine),
# SANITIZER_TIMEOUT (seconds, default 240), SANITIZER_ARGS (more arguments for the job, e.g.
# "--offload" for optimizer-state offload with a streamed step), SANITIZER_API_ERRORS (memcheck's
# --report-api-errors: no (default) | explicit | all; NCCL and torch probe optional driver
# features through calls that fail by design, which "explicit" reports as errors).
# SANITIZER_PYTEST: pytest arguments (e.g. a GPU test's node id) to run under memcheck instead of
# the example, with DC_TEST_DEVICE=cuda; the job must then pass its tests.
# Logs: $OUT/sanitizer.log (compute-sanitizer's report), $OUT/sanitizer-app.log (the job's output).
# Exit status: 0 when the job succeeded and every "ERROR SUMMARY" line reads 0 errors; 2 when
# compute-sanitizer or the built extension is missing; otherwise non-zero (124: time limit).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
STEPS=${SANITIZER_STEPS:-3}
NPROC=${SANITIZER_NPROC:-2}
LIMIT=${SANITIZER_TIMEOUT:-240}
API_ERRORS=${SANITIZER_API_ERRORS:-no}
mkdir -p "$OUT"
LOG="$OUT/sanitizer.log"
APP_LOG="$OUT/sanitizer-app.log"
rm -f "$LOG" "$APP_LOG"
# torchrun puts the script's folder on sys.path, not the repository: also find an in-place build.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

SANITIZER=$(command -v compute-sanitizer || true)
if [ -z "$SANITIZER" ]; then
  for candidate in ${CUDA_HOME:+"$CUDA_HOME/bin/compute-sanitizer"} /usr/local/cuda*/bin/compute-sanitizer \
                   /usr/local/cuda*/compute-sanitizer/compute-sanitizer; do
    if [ -x "$candidate" ]; then SANITIZER=$candidate; break; fi
  done
fi
if [ -z "$SANITIZER" ]; then
  echo "gpu_sanitizer: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda*/bin)" >&2
  exit 2
fi
if ! python3 -c "import deepcompile" > "$APP_LOG" 2>&1; then
  echo "gpu_sanitizer: 'import deepcompile' fails; build it first (scripts/gpu_check.sh):" >&2
  tail -20 "$APP_LOG" >&2
  exit 2
fi
if command -v torchrun > /dev/null; then
  LAUNCH=(torchrun)
else
  LAUNCH=(python3 -m torch.distributed.run)
fi

if [ -n "${SANITIZER_PYTEST:-}" ]; then
  JOB=(env DC_TEST_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider $SANITIZER_PYTEST)
else
  JOB=("${LAUNCH[@]}" --standalone --nproc-per-node "$NPROC" examples/train_llama.py --steps "$STEPS" --backend eager
       ${SANITIZER_ARGS:-})
fi
{
  echo "gpu_sanitizer: $("$SANITIZER" --version 2>&1 | grep -i version | head -1)"
  echo "gpu_sanitizer: memcheck over ${JOB[*]} (limit ${LIMIT}s, api errors: $API_ERRORS)"
} | tee "$OUT/sanitizer-run.txt"

start=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1 \
  timeout --kill-after=10 "$LIMIT" \
  "$SANITIZER" --tool memcheck --target-processes all --require-cuda-init no \
    --launch-timeout 120 --report-api-errors "$API_ERRORS" --error-exitcode 86 --print-limit 100 \
    --log-file "$LOG" \
  "${JOB[@]}" > "$APP_LOG" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))

summaries=$(grep -h "ERROR SUMMARY" "$LOG" 2>/dev/null || true)
n_summaries=$(printf '%s' "$summaries" | grep -c "ERROR SUMMARY" || true)
n_clean=$(printf '%s' "$summaries" | grep -c "ERROR SUMMARY: 0 errors" || true)

echo "--- job output (tail) ---"
tail -15 "$APP_LOG"
echo "--- sanitizer summaries ---"
printf '%s\n' "${summaries:-(none)}"

status=0
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu_sanitizer: FAILED: time limit of ${LIMIT}s reached (rc $rc)"
  status=1
elif [ "$rc" -ne 0 ]; then
  echo "gpu_sanitizer: FAILED: rc $rc (86: memcheck found errors; else the job's own exit status)"
  status=1
fi
if [ "$n_summaries" -eq 0 ]; then
  echo "gpu_sanitizer: FAILED: no ERROR SUMMARY line in $LOG"
  status=1
elif [ "$n_clean" -ne "$n_summaries" ]; then
  echo "gpu_sanitizer: FAILED: memcheck reported errors; first records:"
  grep -v "^========= *$" "$LOG" | head -60
  status=1
fi
if [ -n "${SANITIZER_PYTEST:-}" ]; then
  # A failing test shows in rc above; this catches a selection that ran nothing (all skipped).
  if ! grep -q " passed" "$APP_LOG"; then
    echo "gpu_sanitizer: FAILED: no test passed (all deselected or skipped?)"
    status=1
  fi
elif ! grep -q "single-process check: .* -> OK" "$APP_LOG"; then
  echo "gpu_sanitizer: FAILED: the job did not finish with its single-process check OK"
  status=1
fi
if [ "$status" -eq 0 ]; then
  echo "gpu_sanitizer: OK: $n_summaries ERROR SUMMARY line(s), all 0 errors, ${elapsed}s"
fi
exit "$status"
