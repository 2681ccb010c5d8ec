#!/usr/bin/env bash
# One GPU-machine call for compile.optimizer_step_in_backward (issue 16 part 3): build, then
# bench/checkpointing_memory.py on the ~1B Llama (micro-batch 8, bf16 gradient partitions,
# sub-group step, each decoder layer compiled on its own), without and with the option, side by
# side on two GPUs when there are two (each run on one GPU: per-device peaks), then the tests of
# tests/zero/test_step_in_backward.py over NCCL at every world size the GPUs allow. Logs under $OUT (few
# files: the device tool returns at most 8): regional.json (option off), sib.json (option on),
# bench-*.log (each ends with its markdown block), pytest.log; with TRACE=1, peaks.txt:
# bench/memory_peak.py on the allocator history of one more step of every row.
#
#   OUT=... [TRACE=1] [CALL_BUDGET=0: no tests] bash bench/results/recipes/gpu_step_in_backward.sh
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

gpu_environment

gpu_build
echo "built at $(elapsed) s"

gpus=$(nvidia-smi -L | wc -l)
ARGS="--stages 3 --micro-batch 8 --sub-group-size 1e8 --communication-data-type bf16 --regional --warmup 3 ${SIB_ARGS:-}"
bench() {  # $1: name, $2: GPU, rest: extra options
  local name=$1 gpu=$2; shift 2
  local trace=""; [ "${TRACE:-0}" = 1 ] && trace="--memory-history /tmp/traces-$name --memory-history-stacks ${STACKS:-python}"
  CUDA_VISIBLE_DEVICES=$gpu timeout "${BENCH_TIMEOUT:-300}" torchrun --standalone --nproc-per-node 1 \
    bench/checkpointing_memory.py $ARGS $trace "$@" --json "$OUT/$name.json" > "$OUT/bench-$name.log" 2>&1
  echo "bench $name rc=$? at $(elapsed) s"
}
if [ "$gpus" -ge 2 ]; then
  bench regional 0 & bench sib 1 --optimizer-step-in-backward & wait
else
  bench regional 0; bench sib 0 --optimizer-step-in-backward
fi
for name in regional sib; do sed -n '/^| run /,$p' "$OUT/bench-$name.log" | head -12; done
if [ "${TRACE:-0}" = 1 ]; then
  for history in /tmp/traces-*/*.memory.pickle.gz; do
    echo "== $history"; python3 bench/memory_peak.py "$history" --top 14 --timeline 24
  done > "$OUT/peaks.txt" 2>&1
fi

left=$(( ${CALL_BUDGET:-570} - $(elapsed) ))
sizes=1; [ "$gpus" -ge 2 ] && sizes=1,2
if [ "$left" -gt 60 ]; then
  DC_TEST_DEVICE=cuda DC_TEST_WORLD_SIZES=$sizes timeout "$(( left - 5 ))" python3 -m pytest -q -rs \
    tests/zero/test_step_in_backward.py tests/zero/test_sub_groups.py > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? at $(elapsed) s"; tail -8 "$OUT/pytest.log"
else
  echo "tests skipped: ${left} s left"
fi
