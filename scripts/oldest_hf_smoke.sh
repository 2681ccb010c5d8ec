#!/usr/bin/env bash
# Trainer and accelerate smoke tests on the oldest transformers and accelerate the packaging claims
# (pyproject.toml / requirements-dev.txt lower bounds), beside the newest that CI installs. The
# oldest releases go into a folder of their own (build/hf-oldest, ignored by git) that is put
# ahead of the installed ones on PYTHONPATH, so the environment itself is never changed; spawned
# ranks and torchrun workers inherit the path. Their dependencies (tokenizers, huggingface_hub,
# safetensors) are the installed ones, which the oldest releases accept within 5.x.
#
# Environment: PYTHON (default python3); DC_OLDEST_TRANSFORMERS / DC_OLDEST_ACCELERATE (default:
# the lower bounds read from requirements-dev.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$SECONDS
lower_bound() { sed -n "s/^$1>=\([0-9.]*\).*/\1/p" requirements-dev.txt; }
TRANSFORMERS=${DC_OLDEST_TRANSFORMERS:-$(lower_bound transformers)}
ACCELERATE=${DC_OLDEST_ACCELERATE:-$(lower_bound accelerate)}
TARGET=$PWD/build/hf-oldest
# What the smoke covers: Trainer at ZeRO-3 against one process (with resume and save), the
# accelerate plugin loop and its state round trip, what the Trainer path computes in (bf16 inside
# the forward, reduced gradients), and the ALST sequence-parallel route through both.
TESTS=(
  "tests/integrations/test_hf_trainer.py::test_trainer_zero3_matches_single_process"
  "tests/integrations/test_hf_trainer.py::test_trainer_resume_from_checkpoint_continues_exactly"
  "tests/integrations/test_hf_accelerate.py::test_accelerate_deepspeed_plugin_matches_single_process"
  "tests/integrations/test_hf_accelerate.py::test_accelerate_load_state_continues_exactly"
  tests/integrations/test_hf_trainer_precision.py
  tests/integrations/test_served_ulysses.py
)

want="transformers==$TRANSFORMERS accelerate==$ACCELERATE"
have=$(PYTHONPATH=$TARGET "$PY" -c "import transformers, accelerate; print(f'transformers=={transformers.__version__} accelerate=={accelerate.__version__}')" 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  rm -rf "$TARGET"
  "$PY" -m pip install -q --no-deps --target "$TARGET" "transformers==$TRANSFORMERS" "accelerate==$ACCELERATE"
fi
seen=$(PYTHONPATH=$TARGET "$PY" -c "import transformers, accelerate; print(f'transformers=={transformers.__version__} accelerate=={accelerate.__version__}')")
if [ "$seen" != "$want" ]; then
  echo "oldest_hf_smoke: expected $want on the path, got $seen" >&2
  exit 1
fi
echo "oldest_hf_smoke: $seen (installed: $("$PY" -c "import transformers, accelerate; print(transformers.__version__, accelerate.__version__)"))"
PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
echo "oldest_hf_smoke: done in $((SECONDS - START)) s"
