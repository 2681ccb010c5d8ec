#!/usr/bin/env bash
# GPU run for the joint offload plan (offload/joint.py; one GPU is enough, more are used): builds
# the extension as gpu_offload.sh does and runs the gpu test of tests/offload/test_joint_offload.py under
# DC_TEST_DEVICE=cuda: activation, optimizer-state and parameter offload on together, bitwise
# against no offload, with a roomy and a tight budget; the schedule report of each (measured link,
# predicted transfer and exposed time per kind, predicted vs measured peak) is printed.
# Logs go to $OUT (or ./gpu-logs): pytest_joint_offload.log.
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
gpu_build
DC_TEST_DEVICE=cuda timeout 480 python3 -m pytest -q -rs -s tests/offload/test_joint_offload.py -k gpu -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest_joint_offload.log" | tail -60
exit ${PIPESTATUS[0]}
