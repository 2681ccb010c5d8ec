#!/usr/bin/env bash
# One GPU-machine call for activation checkpointing (issue 16 part 3), within the 10-minute limit:
# build, bench/checkpointing_memory.py (one GPU: ZeRO-3 then ZeRO-1, each plain and checkpointed,
# the ~1B Llama of train_bench, Inductor), then, if time is left, the parity tests of
# tests/parity/test_activation_checkpointing.py over NCCL (world size 1 on one GPU). Logs under $OUT:
# ckpt.md (the markdown block), ckpt.json (rewritten after every row), bench.log, pytest.log.
#
#   OUT=... bash bench/results/recipes/gpu_checkpointing.sh            # CKPT_STAGES=3 for ZeRO-3 only
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

gpu_environment

gpu_build
echo "built at $(elapsed) s"

timeout "${BENCH_TIMEOUT:-420}" torchrun --standalone --nproc-per-node 1 bench/checkpointing_memory.py \
  --stages "${CKPT_STAGES:-3,1}" ${CKPT_ARGS:-} --markdown "$OUT/ckpt.md" --json "$OUT/ckpt.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(elapsed) s"
sed -n '/^| run /,$p' "$OUT/bench.log" | head -20

left=$(( ${CALL_BUDGET:-570} - $(elapsed) ))
if [ "$left" -gt 60 ]; then
  DC_TEST_DEVICE=cuda timeout "$(( left - 5 ))" python3 -m pytest -q -rs tests/parity/test_activation_checkpointing.py \
    --junitxml="$OUT/junit.xml" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? at $(elapsed) s"; tail -5 "$OUT/pytest.log"
else
  echo "tests skipped: ${left} s left"
fi
