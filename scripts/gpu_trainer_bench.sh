#!/usr/bin/env bash
# GPU call: bench/trainer_bench.py's rows (HF Trainer / accelerate on deepcompile and on DeepSpeed,
# one process per row) and, with ENGINE_ROW=1, train_bench's engine-API row of the same model, in
# one call. DeepSpeed comes from the carried .whl/ (scripts/fetch_deepspeed_wheels.sh here first;
# `carry: [".whl"]`). DeepSpeed's install and op build run beside deepcompile's build.
#   TB_ROWS=dc,ds-dc bash scripts/gpu_trainer_bench.sh
#   TB_ROWS=dc-eager,ds-z3 ENGINE_ROW=1 bash scripts/gpu_trainer_bench.sh
#   TB_ARGS="--precision fp16 --accumulation 2" TB_ROWS=dc,ds-dc bash scripts/gpu_trainer_bench.sh
# Everything logs under $OUT; the tables are printed last. CALL_S bounds the whole call (seconds).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
start=$SECONDS
gpu_environment
if ! python3 -c "import deepspeed" 2>/dev/null; then
  gpu_install_deepspeed &
  ds_pid=$!
fi
gpu_build
[ -n "${ds_pid:-}" ] && wait "$ds_pid"
echo "setup done after $((SECONDS - start)) s"
left() { echo $(( ${CALL_S:-570} - (SECONDS - start) )); }

timeout "$(left)" python3 bench/trainer_bench.py --nproc "${TB_NPROC:-2}" --rows "${TB_ROWS:-dc,ds-dc}" \
  --preset "${TB_PRESET:-1b}" --warmup "${TB_WARMUP:-10}" --steps "${TB_STEPS:-30}" \
  --row-timeout "${ROW_TIMEOUT:-330}" ${TB_ARGS:-} --json "$OUT/trainer.json" --markdown "$OUT/trainer.md" \
  > "$OUT/trainer.log" 2>&1
echo "trainer_bench rc=$? after $((SECONDS - start)) s"
if [ -n "${TB_ARGS2:-}" ]; then  # a second table in the same call (e.g. other --set values)
  timeout "$(left)" python3 bench/trainer_bench.py --nproc "${TB_NPROC:-2}" --rows "${TB_ROWS2:-dc}" \
    --preset "${TB_PRESET:-1b}" --warmup "${TB_WARMUP:-10}" --steps "${TB_STEPS:-30}" \
    --row-timeout "${ROW_TIMEOUT:-330}" $TB_ARGS2 --json "$OUT/trainer2.json" --markdown "$OUT/trainer2.md" \
    > "$OUT/trainer2.log" 2>&1
  echo "trainer_bench (2) rc=$? after $((SECONDS - start)) s"; cat "$OUT/trainer2.md" 2>/dev/null
fi
if [ -n "${ENGINE_ROW:-}" ]; then
  timeout "$(left)" python3 bench/train_bench.py --isolate --nproc "${TB_NPROC:-2}" --methods z3-auto \
    --warmup "${TB_WARMUP:-10}" --steps "${TB_STEPS:-30}" --row-timeout 200 ${ENGINE_ARGS:-} --json "$OUT/engine.json" \
    --markdown "$OUT/engine.md" > "$OUT/engine.log" 2>&1
  echo "train_bench rc=$? after $((SECONDS - start)) s"
  grep -E "^(method|---|deepcompile)" "$OUT/engine.log" | tail -4
fi
cat "$OUT/trainer.md" 2>/dev/null || tail -30 "$OUT/trainer.log"
