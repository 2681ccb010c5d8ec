#!/usr/bin/env bash
# GPU run for compile.offload_activation / free_activation (one GPU is enough): builds the
# extension as gpu_offload.sh does and runs the gpu tests of tests/offload/test_activation_memory.py under
# DC_TEST_DEVICE=cuda: bitwise parity with offload on/off and the peak memory it saves against the
# bytes it offloads (printed), and that an offloaded block is not reused while its copy may read it.
# Logs go to $OUT (or ./gpu-logs): pytest_activation_memory.log.
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
gpu_build
DC_TEST_DEVICE=cuda timeout 480 python3 -m pytest -q -rs -s tests/offload/test_activation_memory.py -k gpu -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest_activation_memory.log" | tail -25
exit ${PIPESTATUS[0]}
