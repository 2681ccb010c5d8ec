#!/usr/bin/env bash
# GPU run for the joint offload plan (offload/joint.py; one GPU is enough, more are used): builds
# the extension as gpu_offload.sh does and runs the gpu test of tests/test_joint_offload.py under
# DC_TEST_DEVICE=cuda: activation, optimizer-state and parameter offload on together, bitwise
# against no offload, with a roomy and a tight budget; the schedule report of each (measured link,
# predicted transfer and exposed time per kind, predicted vs measured peak) is printed.
# Logs go to $OUT (or ./gpu-logs): pytest_joint_offload.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
DC_TEST_DEVICE=cuda timeout 480 python3 -m pytest -q -rs -s tests/test_joint_offload.py -k gpu -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest_joint_offload.log" | tail -60
exit ${PIPESTATUS[0]}
