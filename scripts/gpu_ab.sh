#!/usr/bin/env bash
# A/B of two source trees in one GPU-machine call: the tree in .ab/A (an earlier commit, written
# there with `git archive <commit> | tar -x -C .ab/A`, ignored by git and sent with the device
# tool's `carry`) against this checkout (B). Step times move by up to ~10 % between calls on the
# same code, so a change is only judged against a baseline measured in the same call.
#
#   AB_METHODS=z3-prefetch AB_ARGS="--micro-batch 2" AB_ROUNDS=2 bash scripts/gpu_ab.sh
#
# Builds A in place (B must already be built, e.g. by scripts/gpu_session.sh), then runs
# bench/train_bench.py of A, B, A, B, ... (AB_ROUNDS rounds) on AB_NPROC GPUs; the tables go to
# $OUT/ab.log. Each run imports its own tree: train_bench.py puts its checkout first on sys.path.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
[ -f .ab/A/setup.py ] || { echo "gpu_ab.sh: no tree in .ab/A (see the header)"; exit 2; }
export PYTHONUNBUFFERED=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=${MAX_JOBS:-32}
echo "A: source digest $(cd .ab/A && bash scripts/source_digest.sh 2>/dev/null || echo '?')" | tee "$OUT/ab.log"
echo "B: source digest $(bash scripts/source_digest.sh)" | tee -a "$OUT/ab.log"
(cd .ab/A && python3 setup.py build_ext --inplace > "$OUT/ab-build-A.log" 2>&1) || { tail -20 "$OUT/ab-build-A.log"; exit 1; }
# What train_bench.py of A will import (its checkout first on sys.path), and that it loads.
python3 -c "import sys; sys.path.insert(0, '.ab/A'); import deepcompile._C, deepcompile; print('A imports', deepcompile.__file__)" \
  2>&1 | tee -a "$OUT/ab.log"
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for side in A B; do
    root=$([ "$side" = A ] && echo .ab/A || echo .)
    echo "== round $round, $side" | tee -a "$OUT/ab.log"
    timeout "${AB_TIMEOUT:-200}" torchrun --master-port 29614 --nproc-per-node "${AB_NPROC:-1}" "$root/bench/train_bench.py" \
      --methods "${AB_METHODS:-z3-prefetch}" --warmup 4 --steps "${AB_STEPS:-12}" ${AB_ARGS:-} 2>&1 \
      | grep -E "^(method|deepcompile|FSDP2|DDP)|Error|error" | tee -a "$OUT/ab.log"
  done
done
