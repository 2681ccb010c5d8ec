#!/usr/bin/env bash
# GPU run for reading and writing offloaded state (one GPU is enough): builds the extension as
# gpu_offload.sh does, then runs tests/offload/test_offload_state_access.py under DC_TEST_DEVICE=cuda (the
# gpu test: the device memory a save and a load of an offloaded ZeRO-3 engine take), printing the
# measured peaks (-s). Logs go to $OUT (or ./gpu-logs): pytest_offload_state_access.log.
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
gpu_build
DC_TEST_DEVICE=cuda timeout 400 python3 -m pytest -q -s -rs tests/offload/test_offload_state_access.py -k gpu -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest_offload_state_access.log" | tail -20
exit "${PIPESTATUS[0]}"
