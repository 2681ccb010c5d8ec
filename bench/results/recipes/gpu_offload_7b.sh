#!/usr/bin/env bash
# Issue 18's benchmark on one GPU (nvidia-h100-x1 or nvidia-h200): the 7B Llama (hidden 4096,
# 32 layers, 32 heads, intermediate 11008, vocab 32000; micro-batch 1 x seq 2048, bf16, AdamW)
# with FSDP2 + CPU offload against deepcompile's offload rows, PCIe bandwidth measured in the same
# run, transfer/overlap from a torch.profiler trace; and the largest model per system.
#
#   bash bench/results/recipes/gpu_offload_7b.sh PHASE [PHASE ...]      logs and tables under $OUT
#
# Every phase builds first (incremental on a warm machine); all phases of one call share CALL_S
# seconds (default 570: the machine's per-call limit is 600), each a timeout of what is left.
# Phases, each sized for one call of about 550 s (timings on an H100: FSDP2 + CPU offload of 7B runs 10.6 s/step, compiles ~60 s):
#   table-z3      PCIe + z3-offload-budget, z3-offload                         (~5 min)
#   table-z3-all  PCIe + z3-offload-all (all offload kinds; "unavailable" while the config refuses one)
#   table-fsdp2   PCIe + fsdp2-offload (init on the host, ~108 GB pinned)       (~4 min)
#   table         all four rows in one table (one call only if it fits: ~8-10 min)
#   largest-z3    largest layer count that trains, deepcompile LARGEST_Z3_SYSTEM (default z3-offload-budget;
#                 z3-offload-all for parameter offload too) at LARGEST_Z3_LAYERS
#   largest-fsdp2-offload   the same for FSDP2 + CPU offload          (LARGEST_FSDP2_OFFLOAD_LAYERS)
#   largest-nooffload       the same for FSDP2 and deepcompile ZeRO-3 without offload (LARGEST_NOOFFLOAD_LAYERS)
# The tables of separate calls are merged afterwards, anywhere (no GPU):
#   python3 bench/train_bench.py --merge table-fsdp2.json table-z3.json table-z3-all.json --markdown bench/RESULTS.md
# largest-*: bisects the layer list (LARGEST_SEARCH=linear: in order), LARGEST_TIMEOUT s per try.
# Extra train_bench options for the table phases: TABLE_OPTS (e.g. "--offload-passes prefetch --warmup 3").
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
[ $# -ge 1 ] || { sed -n 2,22p "$0"; exit 2; }

start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
free -g | tee -a "$OUT/env.txt"
gpu_build
echo "build: $((SECONDS - start)) s"

# 2 warm-up steps (the first compiles) + 3 timed + 1 traced; one process per row (the 7b preset).
TABLE=(python3 bench/train_bench.py --preset 7b --warmup 2 --steps 3 --trace "$OUT/trace_7b" --trace-steps 1
       --row-timeout 330)
left() { local s=$(( ${CALL_S:-570} - (SECONDS - start) )); echo $(( s > 1 ? s : 1 )); }  # seconds left of this call
table() {  # name, methods
  timeout "$(left)" "${TABLE[@]}" --methods "$2" --json "$OUT/$1.json" --markdown "$OUT/$1.md" ${TABLE_OPTS:-} \
    2>&1 | tee "$OUT/$1.log" | grep -v "Warning\|warn(" | tail -25
  return "${PIPESTATUS[0]}"
}
largest() {  # name, systems, layers
  timeout "$(left)" python3 bench/largest_model.py --systems "$2" --layers "$3" --timeout "${LARGEST_TIMEOUT:-300}" \
    --search "${LARGEST_SEARCH:-binary}" --deadline-s "$(( $(left) - 20 ))" --json "$OUT/$1.json" --markdown "$OUT/$1.md" ${LARGEST_OPTS:-} \
    2>&1 | tee "$OUT/$1.log" | grep "^==\|->\|^|" | tail -30
  return "${PIPESTATUS[0]}"
}

rc=0
for phase in "$@"; do
  echo "== phase $phase ($((SECONDS - start)) s in)"
  case "$phase" in
    table-z3) table table-z3 z3-offload-budget,z3-offload ;;
    table-z3-all) table table-z3-all z3-offload-all ;;
    table-fsdp2) table table-fsdp2 fsdp2-offload ;;
    table) table table fsdp2-offload,z3-offload-budget,z3-offload,z3-offload-all ;;
    largest-z3) largest largest-z3 "${LARGEST_Z3_SYSTEM:-z3-offload-budget}" "${LARGEST_Z3_LAYERS:-32,40,48,56,64}" ;;
    largest-fsdp2-offload) largest largest-fsdp2-offload fsdp2-offload "${LARGEST_FSDP2_OFFLOAD_LAYERS:-32,36,40}" ;;
    largest-nooffload) largest largest-nooffload fsdp2,z3 "${LARGEST_NOOFFLOAD_LAYERS:-16,20,24}" ;;
    *) echo "unknown phase $phase"; rc=2 ;;
  esac
  st=$?
  [ "$st" -eq 0 ] || { echo "phase $phase: exit $st"; rc=1; }
done
echo "done in $((SECONDS - start)) s"
exit $rc
