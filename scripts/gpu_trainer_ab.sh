#!/usr/bin/env bash
# GPU call: an A/B of two settings of the same trainer_bench row, in one call, the order
# alternated each round (A B, B A, A B, ...), so that a setting is judged only against the other
# measured beside it (step times of this path move by 10-15 % between calls and between the first
# and later rows of a call: Inductor's cache is cold for the first).
#   AB_ROW=acc-dc AB_A="--set fault_tolerance.enabled=true" AB_B="--set fault_tolerance.enabled=false" \
#     AB_ROUNDS=3 bash scripts/gpu_trainer_ab.sh
# Rows log under $OUT; the per-row lines and the medians per side are printed last. Needs no
# DeepSpeed (deepcompile rows only). CALL_S bounds the whole call (seconds).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
start=$SECONDS
gpu_environment
gpu_build
echo "setup done after $((SECONDS - start)) s"
left() { echo $(( ${CALL_S:-570} - (SECONDS - start) )); }
results="$OUT/ab.tsv"
: > "$results"
for round in $(seq 1 "${AB_ROUNDS:-3}"); do
  order=$([ $((round % 2)) = 1 ] && echo "A B" || echo "B A")
  for side in $order; do
    args=$([ "$side" = A ] && echo "${AB_A:-}" || echo "${AB_B:-}")
    [ "$(left)" -lt 60 ] && { echo "stopping: $(left) s left"; break 2; }
    timeout "$(left)" python3 bench/trainer_bench.py --nproc "${TB_NPROC:-2}" --rows "${AB_ROW:-acc-dc}" \
      --preset "${TB_PRESET:-1b}" --warmup "${TB_WARMUP:-8}" --steps "${TB_STEPS:-12}" --row-timeout 200 $args \
      --json "$OUT/ab-$round-$side.json" > "$OUT/ab-$round-$side.log" 2>&1
    ms=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(round(r.get('step_ms', float('nan')), 1))" \
      "$OUT/ab-$round-$side.json" 2>/dev/null || echo nan)
    printf "%s\t%s\t%s\t%s\n" "$round" "$side" "$ms" "$args" | tee -a "$results"
  done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
for side in ("A", "B"):
    ms = [float(r[2]) for r in rows if r[1] == side and r[2] != "nan"]
    if ms:
        print(f"{side}: median {statistics.median(ms):.1f} ms over {len(ms)} rows {ms} ({rows[[r[1] for r in rows].index(side)][3]})")
PY
