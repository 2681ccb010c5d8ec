#!/usr/bin/env bash
# GPU run of the checkpoint tests (engine.save_checkpoint / load_checkpoint) and the Sharding
# accessors they build on, over NCCL, one rank per GPU (DC_TEST_DEVICE=cuda). Needs 2 GPUs; the
# 2 -> 3 rank reload needs 3 (skipped, with the reason, on fewer). Also checks the DCP API on the
# machine's torch (2.11). Logs and a JUnit report go to $OUT (or ./gpu-logs).
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tee "$OUT/env.txt"
gpu_build
DC_TEST_DEVICE=cuda timeout ${PYTEST_TIMEOUT:-540} python3 -m pytest -q -rs \
  tests/checkpoint/test_checkpoint.py tests/zero/test_sharding_interface.py --junitxml="$OUT/junit.xml" 2>&1 \
  | tee "$OUT/pytest.log" | tail -40
exit "${PIPESTATUS[0]}"
