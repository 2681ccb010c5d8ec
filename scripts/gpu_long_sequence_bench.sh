#!/usr/bin/env bash
# GPU call (issue 38): bench/long_sequence_bench.py, the longest sequence that trains and tokens/s per
# length with Ulysses sequence parallelism over all the call's GPUs: deepcompile (dc) beside DeepSpeed
# 0.19.8's own Ulysses / ALST route (ds-alst; ds-alst-dc adds its DeepCompile), one torchrun process
# per (system, length). DeepSpeed comes from the carried .whl/ (scripts/fetch_deepspeed_wheels.sh here
# first; `carry: [".whl"]`), installed beside deepcompile's build. Logs, JSON and the Markdown table go to $OUT.
#   bash scripts/gpu_long_sequence_bench.sh                                   # 8B, dc + ds-alst, 32k..512k
#   LS_SEQS=32768,131072 LS_SEARCH=binary bash scripts/gpu_long_sequence_bench.sh
#   LS_SYSTEMS=dc LS_ARGS="--dc-compile-set offload_activation=true" bash scripts/gpu_long_sequence_bench.sh
# LS_PRESET (8b), LS_SYSTEMS (dc,ds-alst), LS_SEQS, LS_SEARCH (linear), LS_NPROC (all GPUs), LS_STEPS (5),
# LS_TRY_S (seconds per try, 300), CALL_S (the whole call, 570 s; the bench's --deadline-s is what is
# left after setup), LS_ARGS (more options).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
start=$SECONDS
gpu_environment
if [[ "${LS_SYSTEMS:-dc,ds-alst}" == *ds-* ]] && ! python3 -c "import deepspeed" 2>/dev/null; then
  gpu_install_deepspeed &
  ds_pid=$!
fi
gpu_build
[ -n "${ds_pid:-}" ] && wait "$ds_pid"
echo "setup done after $((SECONDS - start)) s"
left=$(( ${CALL_S:-570} - (SECONDS - start) - 15 ))

timeout "$((left + 10))" python3 bench/long_sequence_bench.py --preset "${LS_PRESET:-8b}" \
  --systems "${LS_SYSTEMS:-dc,ds-alst}" --seqs "${LS_SEQS:-32768,65536,131072,262144,524288}" \
  --search "${LS_SEARCH:-linear}" --nproc "${LS_NPROC:-$(nvidia-smi -L | wc -l)}" --warmup 1 \
  --steps "${LS_STEPS:-5}" --timeout "${LS_TRY_S:-300}" --deadline-s "$left" ${LS_ARGS:-} \
  --json "$OUT/long_sequence.json" --markdown "$OUT/long_sequence.md" > "$OUT/long_sequence.log" 2>&1
echo "long_sequence_bench rc=$? after $((SECONDS - start)) s"
grep -E "^(== |  -> )" "$OUT/long_sequence.log" | tail -40
cat "$OUT/long_sequence.md" 2>/dev/null || tail -30 "$OUT/long_sequence.log"
