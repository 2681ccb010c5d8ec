#!/usr/bin/env bash
# Issue 18's GPU tests in one call (one GPU is enough; more are used where a test can): builds the
# extension, runs every offload test marked gpu (optimizer-state, parameter, activation and joint
# offload, host memory, the host-buffer release), then compute-sanitizer memcheck over the joint
# offload test (all three kinds planned together under a tight budget).
#
#   bash bench/results/recipes/gpu_offload_suite.sh          logs under $OUT
#
# Environment: SUITE_S (seconds for the whole call, default 560), TESTS_S (the pytest part's limit,
# default 300), SANITIZE (1: run memcheck after the tests, default 1).
set -uo pipefail
source "$(dirname "$0")/../../../scripts/gpu_prelude.sh"
start=$SECONDS
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "source digest $(bash scripts/source_digest.sh)"
} 2>&1 | tee "$OUT/env.txt"
gpu_build
echo "built at $((SECONDS - start)) s"

DC_TEST_DEVICE=cuda timeout "${TESTS_S:-300}" python3 -m pytest -q -rs -p no:cacheprovider -k gpu \
  tests/offload/test_offload.py tests/offload/test_param_offload.py tests/offload/test_joint_offload.py tests/offload/test_activation_memory.py \
  tests/offload/test_host_memory.py tests/offload/test_offload_state_access.py --junitxml="$OUT/junit_offload.xml" \
  > "$OUT/pytest_offload.log" 2>&1
tests=$?
echo "tests rc=$tests at $((SECONDS - start)) s"; tail -8 "$OUT/pytest_offload.log"

san=0
left=$(( ${SUITE_S:-560} - (SECONDS - start) ))
if [ "${SANITIZE:-1}" = 1 ] && [ "$left" -gt 60 ]; then
  SANITIZER_TIMEOUT=$(( left - 10 )) SANITIZER_PYTEST="tests/offload/test_joint_offload.py -k gpu" \
    bash scripts/gpu_sanitizer.sh 2>&1 | tail -12
  san=${PIPESTATUS[0]}
  echo "sanitizer rc=$san at $((SECONDS - start)) s"
elif [ "${SANITIZE:-1}" = 1 ]; then
  echo "sanitizer skipped: ${left} s left"; san=1
fi
exit $(( tests != 0 ? tests : san ))
