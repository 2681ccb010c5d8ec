#!/usr/bin/env bash
# GPU run for optimizer-state offload (one GPU is enough): builds the extension as gpu_check.sh
# does, runs the offload tests under DC_TEST_DEVICE=cuda (parity, freed device memory, no growth)
# and bench/offload_bench.py (ZeRO-3 with and without offload, FSDP2 + CPU offload as the peer).
# Logs go to $OUT (or ./gpu-logs): pytest_offload.log, offload_bench.log, offload_bench.md.
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
gpu_build
DC_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -rs tests/offload/test_offload.py -k gpu -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest_offload.log" | tail -20
tests=${PIPESTATUS[0]}
timeout 420 torchrun --nproc-per-node 1 bench/offload_bench.py --markdown "$OUT/offload_bench.md" "$@" \
  2>&1 | tee "$OUT/offload_bench.log" | tail -12
bench=${PIPESTATUS[0]}
exit $(( tests != 0 ? tests : bench ))
