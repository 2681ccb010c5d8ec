#!/usr/bin/env bash
# One GPU-machine call that does everything a session needs, within the 10-minute limit of a call:
# build, the GPU tests (pytest args from $GPU_TESTS, "none" to skip; DC_TEST_WORLD_SIZES picks the
# world sizes, else they follow the GPUs present), the benchmark rows ($BENCH_METHODS on
# $BENCH_NPROC GPUs, default 2; DeepSpeed rows need .whl carried), and the compute-sanitizer run if time remains. Each part has its own time limit and log under $OUT, so
# a part that runs long costs only its own results.
set -uo pipefail
MAX_JOBS=${MAX_JOBS:-32}
source "$(dirname "$0")/gpu_prelude.sh"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  git log -1 --format='commit %h %s' 2>/dev/null || true
  # The device copy's git metadata can be stale; this digest of the sources is not
  # (scripts/source_digest.sh prints the same for a local commit).
  echo "source digest $(bash scripts/source_digest.sh)"
} 2>&1 | tee "$OUT/env.txt"

gpu_build
echo "built at $(elapsed) s"

if [ "${GPU_TESTS:-tests}" != none ]; then
  DC_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -v -rs ${GPU_TESTS:-tests} \
    --junitxml="$OUT/junit.xml" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? at $(elapsed) s"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest.log" | sed "s/ *\[ *[0-9]*%\]//" | tail -40
fi

if [ -n "${BENCH_METHODS:-}" ]; then
  # DeepSpeed rows (ds-*, e.g. BENCH_METHODS=z3-auto,ds-dc,ds-z3,fsdp2; carry .whl, see
  # scripts/fetch_deepspeed_wheels.sh): DeepSpeed installed first, each row in its own process.
  bench=(torchrun --master-port 29613 --nproc-per-node "${BENCH_NPROC:-2}" bench/train_bench.py --warmup 4)
  if [[ ",$BENCH_METHODS" == *,ds-* ]]; then
    gpu_install_deepspeed
    bench=(python3 bench/train_bench.py --isolate --nproc "${BENCH_NPROC:-2}" --warmup 7)
  fi
  timeout "${BENCH_TIMEOUT:-240}" "${bench[@]}" \
    --methods "$BENCH_METHODS" --steps 8 ${BENCH_ARGS:-} --markdown "$OUT/RESULTS.md" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at $(elapsed) s"; grep -E "^(method|---|deepcompile|DeepSpeed|FSDP2|DDP)" "$OUT/bench.log" | tail -16
fi

left=$(( ${CALL_BUDGET:-570} - $(elapsed) ))
if [ "$left" -gt 60 ] && [ -f scripts/gpu_sanitizer.sh ]; then
  SANITIZER_TIMEOUT=$(( left - 10 )) timeout "$left" bash scripts/gpu_sanitizer.sh > "$OUT/sanitizer.out" 2>&1
  echo "sanitizer rc=$? at $(elapsed) s"; tail -5 "$OUT/sanitizer.out"
else
  echo "sanitizer skipped: ${left} s left"
fi
