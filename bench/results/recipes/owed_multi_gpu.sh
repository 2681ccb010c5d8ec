#!/usr/bin/env bash
# The multi-GPU runs owed (issue 55; NOTES.md, "Runs owed on GPUs"): one job, split into parts that
# each fit one 10-minute device call on the GPUs they name. Run a part by its name:
#
#   bash bench/results/recipes/owed_multi_gpu.sh list                 # every part: GPUs, what it backs
#   bash bench/results/recipes/owed_multi_gpu.sh suite-sp-ws2         # one part (one call)
#   bash bench/results/recipes/owed_multi_gpu.sh --dry-run bench-1b-ws4   # its commands, nothing run
#   DRY_RUN=1 bash bench/results/recipes/owed_multi_gpu.sh all        # every part's commands
#   NPROC=1 bash bench/results/recipes/owed_multi_gpu.sh suite-sp-ws2 # smoke test on one GPU
#
# A part named -wsN needs N GPUs (`nvidia-smi -L | wc -l`) and stops with a message on fewer.
# NPROC=K runs the part at world size K instead (K ranks, K GPUs; CUDA_VISIBLE_DEVICES is cut to
# the first K when more are present): a smoke test of the part on a smaller machine, not the run
# it owes. At NPROC=1 the tests that need 2 or 4 ranks skip with their reason, the bench rows run
# at one rank, and the 8B and long-sequence parts switch to the 1B model and short sequences (an
# 8B ZeRO-3 state does not fit one GPU), so every part can be tried on a one-GPU machine.
#
# Each part builds first (scripts/gpu_prelude.sh: gpu_build; DeepSpeed from the carried .whl/ where
# the part needs it, scripts/fetch_deepspeed_wheels.sh here first, `carry: [".whl"]`), then runs its
# steps through the existing drivers (scripts/gpu_check.sh, gpu_deepspeed.sh, gpu_trainer_bench.sh,
# gpu_long_sequence_bench.sh, gpu_sanitizer.sh, bench/train_bench.py --isolate: one process per
# row). Every step has the time left of CALL_S (default 570 s; a call may run 600). Logs go under
# $OUT/<part>/ (OUT default ./gpu-logs); at the end the part prints a row for
# bench/results/gpu-runs.md (date, machine, tree and source digest, command, result) and appends
# it to $OUT/rows.md; its tables are in $OUT/<part>/*.md for bench/RESULTS.md.
# Overrides (printed in the row when set): NPROC, CALL_S, METHODS (train_bench rows), PEER_REPEATS,
# ROW_TIMEOUT, BENCH_ARGS, LS_SEQS, LS_SEARCH, LS_TRY_S, LS_ARGS, TB_ARGS, PEAK_TFLOPS (MFU's
# denominator, default 989: H100/H200 SXM bf16 dense).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$ROOT" || exit 2
SELF=bench/results/recipes/owed_multi_gpu.sh
GIVEN=()  # the overrides set for this run, for its results row
for v in NPROC CALL_S METHODS PEER_REPEATS ROW_TIMEOUT BENCH_ARGS LS_SEQS LS_SEARCH LS_TRY_S LS_ARGS TB_ARGS PEAK_TFLOPS; do
  [ -n "${!v:-}" ] && GIVEN+=("$v=${!v}")
done
CALL_S=${CALL_S:-570}

# name|GPUs|needs (ds: DeepSpeed from .whl; trl: TRL from .whl/hf)|what it backs. In the order to run
# them when 2 or 4 GPUs are lent: the README's and results page's claims first.
PARTS='trainer-1b-ws2|2|ds|Trainer path 1.13x DeepSpeed DeepCompile (README), Trainer within 5 % of the engine row
trainer-1b-fp16-ws2|2|ds|Trainer fp16 + accumulation 2 against DeepSpeed DeepCompile
accelerate-1b-ws2|2|ds|accelerate loop on deepcompile and on DeepSpeed DeepCompile (acc-ds-dc never ran), engine row beside
bench-1b-ws2|2||1B: ZeRO-3 >= 1.25x FSDP2 + compile; per-layer within 3 % of whole-model (then regional default); causal mask dropped
bench-1b-ds-ws2|2|ds|1B: ZeRO-3 >= 1.15x DeepSpeed DeepCompile (its row never gave a number here)
suite-sp-ws2|2||sequence parallelism over NCCL: parity, packed rows, the group input checks, served Ulysses, tiled loss/MLP
suite-faults-ws2|2||issue 42 over NCCL: async-error abort, device-index refusal, recovery, killed rank, two engines, sanitizer step
trl-dpo-ws2|2|trl|issue 41: TRL DPO with a reference model (ZeRO-3/2), GRPO, the frozen ZeRO-3 engine
suite-parity-ws2|2||ZeRO-1/2 parity, hybrid 2x1/1x2, hpZ, world-size cases at 2 ranks
suite-zero3-ws2|2||ZeRO-3 parity, activation checkpointing, variable lengths at 2 ranks
suite-sched-ws2|2||scheduling suite, per-layer prefetch counts under a real budget, stress parity with grad norms, memory lifetimes
suite-core-ws2|2||the rest of the device suite at 2 ranks (zero, compiler, precision), JUnit kept
suite-served-ws2|2|trl|served APIs on GPUs: LoRA saves, safe_get_*, SFTTrainer, zero.Init slices and dtype, Lightning teardown, offload_states
suite-hf-ws2|2||Trainer tests on GPUs: compiled PEFT LoRA, fp16, accelerate regional compilation through a real launch
trace-1b-ws2|2||ZeRO-3 peak vs FSDP2 at 2 GPUs, is the ZeRO-3 step host-bound, what per-layer graphs leave exposed
hybrid-ws2|2||hybrid 2x1 and hpZ 2 step cost on the current tree (README), trace of the replica all-reduce
memcheck-ws2|2||compute-sanitizer memcheck of the README job at 2 ranks
trainer-8b-ws2|2||8B Trainer row, micro-batch 1 (its first compile outran 270 s)
trainer-8b-ds-ws2|2|ds|8B DeepSpeed DeepCompile Trainer row (never gave a step)
bench-8b-ws2|2||8B: ZeRO-3 >= 1.25x FSDP2 + compile
bench-8b-layers-ws2|2||8B: per-layer within 3 % of whole-model
bench-8b-ds-ws2|2|ds|8B: ZeRO-3 >= 1.15x DeepSpeed DeepCompile
longseq-32k-ws2|2|ds|8B tokens/s at 32k with SP 2: deepcompile vs DeepSpeed Ulysses (fallback if 4 GPUs are not lent)
longseq-max-dc-ws2|2||longest sequence that trains with SP 2, deepcompile + tiled loss/MLP
longseq-max-alst-ws2|2|ds|longest sequence that trains with SP 2, DeepSpeed Ulysses
suite-sp-ws4|4||sequence parallelism at SP 4 and SP 2 x DP 2 over NCCL, packed rows, group checks of 4
suite-faults-ws4|4||failure paths and killed ranks with 4 ranks (three survivors name the dead one)
suite-parity-ws4|4||ZeRO-1/2 parity, hybrid 2x2/1x4, hpZ, 3- and 4-rank cases
suite-zero3-ws4|4||ZeRO-3 parity at 4 ranks (not reached in the last 4-GPU run)
suite-sched-ws4|4||scheduling, per-layer prefetch, stress and memory at 4 ranks
bench-1b-ws4|4||1B at 4 GPUs: the ratios again, tokens/s/GPU >= 95 % of 2 GPUs
bench-1b-ds-ws4|4|ds|1B at 4 GPUs: ZeRO-3 >= 1.15x DeepSpeed DeepCompile
bench-8b-ws4|4||8B at 4 GPUs: ZeRO-3 >= 1.25x FSDP2 + compile, scaling from 2
bench-8b-layers-ws4|4||8B at 4 GPUs: per-layer within 3 % of whole-model
bench-8b-ds-ws4|4|ds|8B at 4 GPUs: ZeRO-3 >= 1.15x DeepSpeed DeepCompile
longseq-32k-ws4|4|ds|8B tokens/s at 32k with SP 4: deepcompile vs DeepSpeed Ulysses
longseq-max-dc-ws4|4||longest sequence with SP 4, deepcompile + tiled loss/MLP (must beat ALST)
longseq-max-alst-ws4|4|ds|longest sequence with SP 4, DeepSpeed Ulysses
longseq-alst-dc-ws4|4|ds|DeepSpeed DeepCompile on the Ulysses mpu (ds-alst-dc, never ran)
hybrid-ws4|4||Trainer with mics_shard_size as 2x2, hybrid/hpZ tests, 2x2 step cost
checkpoint-ws4|4||checkpoints over NCCL and the 2 -> 3 rank reload (3 GPUs suffice)
offload-ws1|1||offload GPU tests after the parts refactor, memory lifetimes at world 1'

usage() { sed -n 2,29p "$ROOT/$SELF"; }
meta() {  # $1: part; sets GPUS, NEEDS, BACKS; 1 when unknown
  local line
  line=$(printf '%s\n' "$PARTS" | grep -m1 "^$1|") || return 1
  IFS='|' read -r _ GPUS NEEDS BACKS <<< "$line"
}
list_parts() {
  printf '%-22s %-4s %-5s %s\n' part GPUs needs "what it backs"
  printf '%s\n' "$PARTS" | while IFS='|' read -r name gpus needs backs; do
    printf '%-22s %-4s %-5s %s\n' "$name" "$gpus" "${needs:--}" "$backs"
  done
}

DRY=${DRY_RUN:-0}
[ "$DRY" = 0 ] || DRY=1
parts=()
for arg in "$@"; do
  case "$arg" in
    -n|--dry-run) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) parts+=("$arg") ;;
  esac
done
[ ${#parts[@]} -gt 0 ] || { usage; exit 2; }
if [ "${parts[0]}" = list ]; then list_parts; exit 0; fi
if [ "${parts[0]}" = all ]; then
  [ "$DRY" = 1 ] || { echo "'all' is for --dry-run only: each part is one device call"; exit 2; }
  mapfile -t parts < <(printf '%s\n' "$PARTS" | cut -d'|' -f1)
fi
for p in "${parts[@]}"; do meta "$p" || { echo "unknown part '$p' (bash $SELF list)"; exit 2; }; done
[[ -z "${NPROC:-}" || "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "NPROC must be a world size >= 1, got '$NPROC'"; exit 2; }

OUT=${OUT:-gpu-logs}
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
if [ "$DRY" = 0 ]; then
  source "$ROOT/scripts/gpu_prelude.sh"  # gpu_build, gpu_environment, gpu_install_*; cd to the root
fi

# --------------------------------------------------------------------------------------- helpers
left() { local s=$(( CALL_S - (SECONDS - PART_START) )); echo $(( s > 1 ? s : 1 )); }
less() { local s=$(( $(left) - $1 )); echo $(( s > 30 ? s : 30 )); }  # what is left, minus a margin
shown() {  # an assignment or argument as one would type it
  local a=$1 value
  if [[ "$a" =~ ^[A-Z_][A-Z0-9_]*= ]]; then
    value=${a#*=}
    printf '%s=' "${a%%=*}"
  else
    value=$a
  fi
  if [[ "$value" =~ ^[A-Za-z0-9_./:=,@+%-]*$ ]]; then printf '%s' "$value"; else printf "'%s'" "${value//\'/\'\\\'\'}"; fi
}
# step LABEL VAR=value ... -- COMMAND ARGS...: runs COMMAND with those variables, OUT=$PART_OUT/LABEL,
# within what is left of CALL_S; its output to $PART_OUT/LABEL.out, its tail here.
step() {
  local label=$1; shift
  local envs=("OUT=$PART_OUT/$label") words=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  if [ "$DRY" = 1 ]; then
    for a in "${envs[@]}" "$@"; do words+=("$(shown "$a")"); done
    echo "  [$label, at most $(left) s] ${words[*]}"
    return 0
  fi
  local limit; limit=$(left)
  if [ "$limit" -lt 40 ]; then echo "step $label skipped: $limit s left of CALL_S=$CALL_S"; STEPS+=("$label skipped"); return 124; fi
  mkdir -p "$PART_OUT/$label"
  echo "== step $label ($((SECONDS - PART_START)) s in, at most $limit s)"
  env "${envs[@]}" timeout --kill-after=15 "$limit" "$@" > "$PART_OUT/$label.out" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-30}" "$PART_OUT/$label.out"
  echo "step $label rc=$rc"
  STEPS+=("$label rc $rc")
  return $rc
}
check_gpus() {  # $1: GPUs the run needs
  if [ "$DRY" = 1 ]; then echo "  [check] nvidia-smi -L | wc -l >= $1, else stop"; return 0; fi
  local have
  have=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$have" -lt "$1" ]; then
    echo "part $PART needs $1 GPU(s) at world size $1; this machine has $have (nvidia-smi -L)." \
         "Run it on a kind with $1 GPUs (nvidia-h100-x$1 / nvidia-h200-x$1)$([ "$have" -gt 0 ] && echo \
         ", or smoke-test it here with NPROC=$have")."
    return 3
  fi
  if [ -n "${NPROC:-}" ] && [ "$have" -gt "$NPROC" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NPROC - 1))); export CUDA_VISIBLE_DEVICES
    echo "NPROC=$NPROC: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
  fi
}
setup() {  # build; DeepSpeed / TRL where the part needs them (from the carried .whl/)
  local ds_pid=""
  if [ "$DRY" = 1 ]; then
    echo "  [setup] scripts/gpu_prelude.sh: gpu_environment, gpu_build${NEEDS:+; needs $NEEDS from .whl/}"
    return 0
  fi
  mkdir -p "$PART_OUT"
  OUT=$PART_OUT gpu_environment > /dev/null
  if [[ "$NEEDS" == *ds* ]] && ! python3 -c "import deepspeed" 2>/dev/null; then
    ls .whl/deepspeed-*.tar.gz > /dev/null 2>&1 || {
      echo "part $PART needs DeepSpeed: run scripts/fetch_deepspeed_wheels.sh here and carry .whl"; return 4; }
    (OUT=$PART_OUT gpu_install_deepspeed) &
    ds_pid=$!
  fi
  if [[ "$NEEDS" == *trl* ]] && ! python3 -c "import trl" 2>/dev/null; then
    ls .whl/hf/trl-*.whl > /dev/null 2>&1 || {
      echo "part $PART needs TRL: run scripts/fetch_deepspeed_wheels.sh here (fills .whl/hf) and carry .whl"; return 4; }
    OUT=$PART_OUT gpu_install_hf_extras
  fi
  (OUT=$PART_OUT gpu_build) || { [ -n "$ds_pid" ] && wait "$ds_pid"; return 1; }
  if [ -n "$ds_pid" ]; then wait "$ds_pid" || { echo "DeepSpeed install failed: $PART_OUT/deepspeed-install.log"; return 4; }; fi
  echo "setup done after $((SECONDS - PART_START)) s"
}

# One table of deepcompile/peer rows (train_bench.py, one process per row) at world W.
train_bench() {  # label, methods, extra train_bench args...
  local label=$1 methods=$2; shift 2
  # shellcheck disable=SC2086  # BENCH_ARGS: more options, split into words
  step "$label" -- python3 bench/train_bench.py --isolate --nproc "$W" --methods "${METHODS:-$methods}" \
    --warmup 7 --steps 8 --peer-repeats "${PEER_REPEATS:-1}" "$@" ${BENCH_ARGS:-} \
    --json "$PART_OUT/$label.json" --markdown "$PART_OUT/$label.md"
}
tests() {  # label, pytest args...: scripts/gpu_check.sh at world W (its JUnit report kept)
  local label=$1; shift
  step "$label" DC_TEST_WORLD_SIZES="$W" PYTEST_TIMEOUT="$(less 45)" -- bash scripts/gpu_check.sh "$@"
}
preset_8b() {  # the 8B model; train_bench's 1B default at a smoke test (an 8B ZeRO-3 state does not fit one GPU)
  [ "$SMOKE" = 1 ] || echo "--preset 8b --micro-batch 1"
}

# ----------------------------------------------------------------------------------------- parts
body() {
  local seqs
  case "$PART" in
    suite-sp-ws*)
      tests pytest tests/sequence_parallel tests/integrations/test_served_ulysses.py \
        tests/memory/test_tiled_mlp.py tests/memory/test_tiled_loss.py ;;
    suite-faults-ws*)
      step pytest DC_TEST_WORLD_SIZES="$W" PYTEST_TIMEOUT="$(less 200)" -- bash scripts/gpu_check.sh \
        tests/runtime/test_failure_paths.py tests/runtime/test_gpu_lanes.py tests/runtime/test_lifecycle.py \
        tests/engine/test_second_engine.py tests/faults/test_faults.py
      # issue 42 item 5: a ZeRO-3 accumulation window under torch's CUDA sanitizer, now with a peer.
      step cuda-sanitizer TORCH_CUDA_SANITIZER=1 DC_TEST_WORLD_SIZES="$W" PYTEST_TIMEOUT="$(less 40)" -- \
        bash scripts/gpu_check.sh tests/parity/test_zero3_parity.py -k "test_zero3_gradient_accumulation and not clipping" ;;
    suite-parity-ws*)
      tests pytest tests/parity/test_zero12_parity.py tests/parity/test_hybrid_sharding.py tests/parity/test_hpz.py \
        tests/parity/test_world_sizes.py tests/parity/test_multinode_launch.py ;;
    suite-zero3-ws*)
      tests pytest tests/parity/test_zero3_parity.py tests/parity/test_activation_checkpointing.py \
        tests/parity/test_variable_lengths.py ;;
    suite-sched-ws*)
      tests pytest tests/scheduling tests/compiler/test_regional_compile.py tests/compiler/test_per_layer_compile.py \
        tests/runtime/test_gpu_stress.py tests/memory/test_gpu_memory.py ;;
    suite-core-ws*)
      tests pytest tests/zero tests/compiler tests/precision ;;
    suite-served-ws*)
      tests pytest tests/integrations/test_served_lora_save.py tests/integrations/test_served_safe_get.py \
        tests/integrations/test_hf_sft.py tests/integrations/test_zero_init.py tests/clients/test_transformers_zero_init_dtype.py \
        tests/integrations/test_served_lightning.py tests/integrations/test_served_offload_states.py ;;
    suite-hf-ws*)
      tests pytest tests/integrations/test_hf_trainer.py tests/integrations/test_hf_trainer_fp16.py \
        tests/integrations/test_hf_accelerate.py ;;
    trl-dpo-ws*)
      tests pytest tests/integrations/test_served_frozen_engine.py tests/integrations/test_served_generation.py ;;
    offload-ws*)
      tests pytest tests/offload tests/memory/test_gpu_memory.py -k gpu ;;
    checkpoint-ws*)  # its own world sizes (2 and 3) unless NPROC narrows them
      step pytest ${NPROC:+DC_TEST_WORLD_SIZES=$W} PYTEST_TIMEOUT="$(less 45)" -- \
        bash bench/results/recipes/gpu_checkpoint_check.sh ;;
    memcheck-ws*)
      step memcheck SANITIZER_NPROC="$W" SANITIZER_TIMEOUT="$(less 20)" -- bash scripts/gpu_sanitizer.sh ;;
    bench-1b-ws*)
      train_bench bench z3-prefetch,z3-prefetch-regional,z3-auto,fsdp2 --row-timeout "${ROW_TIMEOUT:-120}" ;;
    bench-8b-ws*)
      # shellcheck disable=SC2046  # preset_8b's words
      train_bench bench z3-auto,fsdp2 $(preset_8b) --row-timeout "${ROW_TIMEOUT:-250}" ;;
    bench-8b-layers-ws*)
      # shellcheck disable=SC2046
      train_bench bench z3-prefetch,z3-prefetch-regional $(preset_8b) --row-timeout "${ROW_TIMEOUT:-250}" ;;
    bench-1b-ds-ws*|bench-8b-ds-ws*)  # deepcompile beside DeepSpeed DeepCompile, each row its own process
      local ds_preset=()
      [[ "$PART" == bench-8b-* && "$SMOKE" = 0 ]] && ds_preset=(DS_PRESET=8b DS_MICRO_BATCH=1)
      step bench "${ds_preset[@]}" BENCH_NPROC="$W" BENCH_METHODS="${METHODS:-z3-auto,ds-dc}" \
        PEER_REPEATS="${PEER_REPEATS:-1}" ROW_TIMEOUT="${ROW_TIMEOUT:-240}" BENCH_TIMEOUT="$(less 30)" \
        BENCH_ARGS="${BENCH_ARGS:-}" -- bash scripts/gpu_deepspeed.sh ;;
    trace-1b-ws*)
      train_bench bench z3-prefetch,z3-prefetch-regional,fsdp2 --row-timeout "${ROW_TIMEOUT:-150}" \
        --trace "$PART_OUT/traces" --trace-steps 1
      # shellcheck disable=SC2016  # expanded by the inner bash
      step memory-peak -- bash -c 'shopt -s nullglob; for f in "$1"/*.memory.pickle.gz; do echo "== $f"; python3 bench/memory_peak.py "$f" --top 15; done' \
        _ "$PART_OUT/traces" ;;
    hybrid-ws*)
      local layouts=plain
      [ "$W" -ge 2 ] && layouts="plain,$([ "$W" -ge 4 ] && echo 2x$((W / 2)) || echo 2x1),hpz2"
      if [ "$W" -ge 4 ]; then
        step pytest DC_TEST_WORLD_SIZES="$W" PYTEST_TIMEOUT="$(less 200)" -- bash scripts/gpu_check.sh \
          tests/integrations/test_hf_trainer.py::test_trainer_hybrid_sharding_matches_single_process \
          tests/parity/test_hybrid_sharding.py tests/parity/test_hpz.py
      fi
      # shellcheck disable=SC2086  # BENCH_ARGS
      step bench -- torchrun --standalone --nproc-per-node "$W" bench/train_bench.py --methods "${METHODS:-z3-prefetch}" \
        --layouts "$layouts" --warmup 4 --steps 8 --trace "$PART_OUT/traces" --trace-steps 1 ${BENCH_ARGS:-} \
        --json "$PART_OUT/bench.json" --markdown "$PART_OUT/bench.md" ;;
    trainer-1b-ws*)
      step trainer TB_NPROC="$W" TB_ROWS=dc,ds-dc ENGINE_ROW=1 TB_ARGS="${TB_ARGS:-}" CALL_S="$(less 5)" -- \
        bash scripts/gpu_trainer_bench.sh ;;
    trainer-1b-fp16-ws*)
      step trainer TB_NPROC="$W" TB_ROWS=dc,ds-dc TB_ARGS="${TB_ARGS:---precision fp16 --accumulation 2}" TB_STEPS=20 \
        CALL_S="$(less 5)" -- bash scripts/gpu_trainer_bench.sh ;;
    accelerate-1b-ws*)
      step trainer TB_NPROC="$W" TB_ROWS=acc-dc,acc-ds-dc ENGINE_ROW=1 TB_STEPS=20 TB_ARGS="${TB_ARGS:-}" \
        CALL_S="$(less 5)" -- bash scripts/gpu_trainer_bench.sh ;;
    trainer-8b-ws*|trainer-8b-ds-ws*)  # one row, the whole call (no DeepSpeed install wait for the dc row)
      local row=dc preset=8b
      [[ "$PART" == trainer-8b-ds-* ]] && row=ds-dc
      [ "$SMOKE" = 1 ] && preset=1b
      # shellcheck disable=SC2086  # TB_ARGS: more options
      step trainer -- python3 bench/trainer_bench.py --nproc "$W" --rows "$row" --preset "$preset" --warmup 6 \
        --steps 10 --row-timeout "${ROW_TIMEOUT:-$(less 30)}" ${TB_ARGS:-} \
        --json "$PART_OUT/trainer.json" --markdown "$PART_OUT/trainer.md" ;;
    longseq-*)
      local systems=dc,ds-alst search=linear try=240 steps=5 args="" preset=8b
      seqs=32768
      case "$PART" in
        longseq-max-dc-*) systems=dc; seqs=65536,131072,262144,524288; search=binary; try=300; steps=2
          args="--dc-compile-set tiled_loss=true --dc-compile-set tiled_mlp=true" ;;
        longseq-max-alst-*) systems=ds-alst; seqs=65536,131072,262144,524288; search=binary; try=300; steps=2 ;;
        longseq-alst-dc-*) systems=ds-alst-dc; try=400 ;;
      esac
      if [ "$SMOKE" = 1 ]; then preset=1b; seqs=8192; try=200; steps=2; fi
      step long-sequence LS_PRESET="$preset" LS_SYSTEMS="$systems" LS_SEQS="${LS_SEQS:-$seqs}" \
        LS_SEARCH="${LS_SEARCH:-$search}" LS_NPROC="$W" LS_STEPS="$steps" LS_TRY_S="${LS_TRY_S:-$try}" \
        LS_ARGS="${LS_ARGS:-$args}" CALL_S="$(less 5)" -- bash scripts/gpu_long_sequence_bench.sh ;;
    *) echo "no body for part $PART"; return 2 ;;
  esac
}

# The part's row for bench/results/gpu-runs.md: date, machine, tree, command, result.
results_row() {  # $1: the part's exit status
  local when machine tree cmd result v
  when=$(date -u '+%Y-%m-%d %H:%M')
  machine=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c \
    | awk '{n=$1; $1=""; sub(/^ /, ""); printf "%s%s x %s", s, n, $0; s=", "}')
  tree="$(git rev-parse --short HEAD 2>/dev/null || echo '?') (digest $(bash scripts/source_digest.sh 2>/dev/null || echo '?'))"
  cmd=""
  for v in "${GIVEN[@]}"; do cmd+="$(shown "$v") "; done
  cmd+="bash $SELF $PART"
  result=$(python3 - "$PART_OUT" "${PEAK_TFLOPS:-989}" <<'PY'
import glob, json, os, sys
import xml.etree.ElementTree as ET
out, peak = sys.argv[1], float(sys.argv[2])
parts = []
for path in sorted(glob.glob(os.path.join(out, "**", "junit.xml"), recursive=True)):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        parts.append(f"{os.path.relpath(path, out)}: unreadable"); continue
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    parts.append(f"{os.path.dirname(os.path.relpath(path, out)) or 'tests'}: {passed} passed, {n['failures']} failed, "
                 f"{n['errors']} errors, {n['skipped']} skipped")
def num(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "?"
for path in sorted(glob.glob(os.path.join(out, "**", "*.json"), recursive=True)):
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        continue
    if not isinstance(data, dict):
        continue
    for r in data.get("rows", []) if isinstance(data.get("rows"), list) else []:
        name = r.get("label") or r.get("method") or r.get("key")
        if r.get("status") != "ok":
            parts.append(f"{name}: {r.get('status')}"); continue
        cell = f"{name}: {num(r.get('step_ms'), '.1f')} ms, {num(r.get('tokens_per_s'), ',.0f')} tok/s/GPU"
        if isinstance(r.get("tflops"), (int, float)):
            cell += f", MFU {100 * r['tflops'] / peak:.1f} %"
        cell += f", {num(r.get('peak_gib'), '.2f')} GiB"
        parts.append(cell)
    for s in data.get("systems", []) if isinstance(data.get("systems"), list) else []:
        best, fail = s.get("longest"), s.get("first_failure")
        cell = f"{s.get('system')}: longest {best['seq']:,} ({num(best.get('tokens_per_s'), ',.0f')} tok/s)" if best \
            else f"{s.get('system')}: none trains"
        if fail:
            cell += f", {fail['seq']:,} {fail['status']}"
        parts.append(cell)
print("; ".join(parts) or "no JUnit report or JSON table")
PY
)
  local steps
  steps=$(printf '%s, ' "${STEPS[@]}"); steps=${steps%, }
  local row="| $when | $machine | $tree | \`$cmd\` | rc $1 (${steps:-no step}); $result |"
  echo "== results row (bench/results/gpu-runs.md: time, machine, tree, what ran, result):"
  echo "$row"
  echo "$row" >> "$OUT/rows.md"
  for md in "$PART_OUT"/*.md "$PART_OUT"/*/*.md; do  # the tables, for bench/RESULTS.md
    [ -f "$md" ] && { echo "== $md"; cat "$md"; }
  done
}

run_part() {
  PART=$1; PART_START=$SECONDS; STEPS=()
  meta "$PART"
  W=${NPROC:-$GPUS}
  SMOKE=0; [ "$W" -lt "$GPUS" ] && SMOKE=1
  PART_OUT=$OUT/$PART
  local note=""
  [ "$SMOKE" = 1 ] && note=" (smoke test: the run owed needs $GPUS GPUs)"
  echo "== part $PART: world size $W$note; $BACKS"
  check_gpus "$W" || return $?
  setup || return $?
  body
  local rc=$?
  [ "$DRY" = 1 ] || results_row "$rc"
  return $rc
}

status=0
for p in "${parts[@]}"; do
  ( run_part "$p" ) || status=$?
done
exit $status
