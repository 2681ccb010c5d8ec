#!/usr/bin/env bash
# GPU run of the test suite (the `device` machine: 2 GPUs, NCCL). Builds the extension with the
# system g++ (the machine's /opt/gcc toolchain miscompiles exception messages), then runs every
# pytest test with DC_TEST_DEVICE=cuda: the same multi-rank bodies on NCCL, one rank per GPU.
# Logs and a JUnit report go to $OUT (or ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ MAX_JOBS=${MAX_JOBS:-16}
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
DC_TEST_DEVICE=cuda timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -q -rs tests "$@" \
  --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log" | tail -40
exit "${PIPESTATUS[0]}"
