#!/usr/bin/env bash
# GPU run of the test suite (the `device` machine: 2 GPUs, NCCL). Builds the extension with the
# system g++ (the machine's /opt/gcc toolchain miscompiles exception messages), then runs every
# pytest test with DC_TEST_DEVICE=cuda: the same multi-rank bodies on NCCL, one rank per GPU.
# Logs and a JUnit report go to $OUT (or ./gpu-logs). The last line says how many tests ran at
# world size 1 only (the JUnit report gives each test's world sizes).
#   bash scripts/gpu_check.sh                                  # the whole suite
#   bash scripts/gpu_check.sh -k stress                        # the whole suite, filtered
#   bash scripts/gpu_check.sh tests/runtime/test_gpu_stress.py -x      # only the files named first
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.txt"
gpu_build
gpu_install_hf_extras  # the served TRL tests skip without TRL
# Test paths given first replace the default `tests`; options alone filter the whole suite.
targets=(tests)
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then targets=(); fi
DC_TEST_DEVICE=cuda timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -q -rs "${targets[@]}" "$@" \
  --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log" | tail -40
status=${PIPESTATUS[0]}
world_size_summary "$OUT/pytest.log"
exit "$status"
