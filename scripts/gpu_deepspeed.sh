#!/usr/bin/env bash
# GPU call (no network there): install DeepSpeed from the .whl/ that scripts/fetch_deepspeed_wheels.sh
# filled here (carry it: `carry: [".whl"]`), build deepcompile, then run bench/train_bench.py's table with
# DeepSpeed's rows beside deepcompile's, each row in its own process (--isolate: DeepSpeed's DeepCompile
# and deepcompile register the same torch op namespace `dc`). Logs, JSON and the Markdown table go to $OUT.
#   bash scripts/gpu_deepspeed.sh                 # install + the 1B table (BENCH_METHODS below)
#   DS_PRESET=8b bash scripts/gpu_deepspeed.sh    # the 8B preset (Llama-3-8B shapes), micro-batch $DS_MICRO_BATCH
#   DS_INSTALL_ONLY=1 bash scripts/gpu_deepspeed.sh
# BENCH_METHODS: the rows (train_bench --methods keys); the default is issue 31's table: deepcompile's ZeRO-3
# rows, DeepSpeed DeepCompile, DeepSpeed ZeRO-3 and FSDP2 + compile (the peers twice each: --peer-repeats 2).
# Other examples:
#   BENCH_METHODS=z3-offload-budget,ds-dc-offload-opt,ds-z3-offload-opt,ds-z3-offload DS_PRESET=8b ...
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
gpu_environment

gpu_install_deepspeed
[ -n "${DS_INSTALL_ONLY:-}" ] && exit 0

gpu_build
BENCH_METHODS=${BENCH_METHODS:-z3,z3-prefetch,z3-auto,ds-dc,ds-z3,fsdp2}
preset=()
[ -n "${DS_PRESET:-}" ] && preset=(--preset "$DS_PRESET" --micro-batch "${DS_MICRO_BATCH:-1}")
# --warmup 7: DeepSpeed DeepCompile re-plans at step 5; --row-timeout: a hung row costs only its own row.
timeout "${BENCH_TIMEOUT:-560}" python3 bench/train_bench.py --isolate --nproc "${BENCH_NPROC:-2}" "${preset[@]}" \
  --methods "$BENCH_METHODS" --warmup 7 --steps "${BENCH_STEPS:-8}" --peer-repeats "${PEER_REPEATS:-2}" \
  --row-timeout "${ROW_TIMEOUT:-240}" ${BENCH_ARGS:-} --json "$OUT/deepspeed.json" --markdown "$OUT/RESULTS.md" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "^(method|---|deepcompile|DeepSpeed|FSDP2|DDP)" "$OUT/bench.log" | tail -16
