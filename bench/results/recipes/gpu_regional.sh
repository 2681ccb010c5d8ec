#!/usr/bin/env bash
# One GPU-machine call for shared graph instances and regional compilation (issue 16 part 6),
# plus the offload GPU tests changed since their last GPU run (issue 18), on one GPU:
#   1. build;
#   2. the tests the change touches, at world size 1 (per-layer and regional compilation, the
#      ZeRO-3 / ZeRO-1/2 parity suites, the runtime op suites, the offload GPU tests);
#   3. time to the first scheduled step side by side, cold Inductor cache and warm restart:
#      ZeRO-3 + prefetch compiled whole, the same per layer, FSDP2 + compile
#      (bench/train_bench.py default 1B model); the table goes to $OUT/compile.md.
# Each part has its own time limit, so a part that runs long costs only its own results.
#
#   bash bench/results/recipes/gpu_regional.sh              # from the device tool: OUT is set there
#   BENCH_NPROC=2 TEST_WORLD_SIZES=2 bash bench/results/recipes/gpu_regional.sh   # on 2 GPUs (prefetch across layers)
# REGIONAL_TESTS=0 / OFFLOAD_TESTS=0 skip a test part; the bench gets the rest of CALL_S seconds.
set -uo pipefail
MAX_JOBS=${MAX_JOBS:-16}
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
{
  date -u; nvidia-smi --query-gpu=name --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "source digest $(bash scripts/source_digest.sh)"
} 2>&1 | tee "$OUT/env.txt"
gpu_build
echo "built at $(elapsed) s"

if [ "${REGIONAL_TESTS:-1}" = 1 ]; then
  # (Node ids, not -k: a -k filter applies to every file, and test_per_layer_compile's names
  # matched none of its words.)
  DC_TEST_DEVICE=cuda DC_TEST_WORLD_SIZES=${TEST_WORLD_SIZES:-1} timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs \
    tests/compiler/test_per_layer_compile.py tests/compiler/test_regional_compile.py tests/runtime \
    tests/parity/test_zero3_parity.py::test_zero3_parity tests/parity/test_zero3_parity.py::test_zero3_qwen2_moe \
    tests/parity/test_zero3_parity.py::test_zero3_custom_op_that_cannot_be_compiled \
    tests/parity/test_zero3_parity.py::test_zero3_forward_that_raises_leaves_no_gathered_copy \
    > "$OUT/pytest-regional.log" 2>&1
  echo "regional tests rc=$? at $(elapsed) s"; tail -5 "$OUT/pytest-regional.log"
fi
if [ "${OFFLOAD_TESTS:-1}" = 1 ]; then
  DC_TEST_DEVICE=cuda timeout "${OFFLOAD_TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -k gpu \
    tests/offload/test_activation_memory.py tests/offload/test_offload.py tests/offload/test_param_offload.py \
    > "$OUT/pytest-offload.log" 2>&1
  echo "offload GPU tests rc=$? at $(elapsed) s"; tail -5 "$OUT/pytest-offload.log"
fi

# The bench gets what is left of CALL_S (default 580: the device tool's per-call limit is 600).
bench_s=$(( ${CALL_S:-580} - $(elapsed) )); [ "$bench_s" -gt 30 ] || { echo "no time left for the bench"; exit 0; }
timeout "${BENCH_TIMEOUT:-$bench_s}" torchrun --nproc-per-node "${BENCH_NPROC:-1}" bench/train_bench.py \
  --methods "${BENCH_METHODS:-z3-prefetch,z3-prefetch-regional,fsdp2}" --warmup 3 --steps 3 \
  --compile-cache cold --warm-start --markdown "$OUT/compile.md" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(elapsed) s"; cat "$OUT/compile.md" 2>/dev/null || tail -20 "$OUT/bench.log"
