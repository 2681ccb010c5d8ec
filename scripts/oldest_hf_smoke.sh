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

# Whether the folder's releases are the ones wanted (compared as versions: 5.17 is 5.17.0).
on_path() {
  PYTHONPATH=$TARGET "$PY" - "$TRANSFORMERS" "$ACCELERATE" <<'PYEOF'
import sys
from packaging.version import Version
import accelerate, transformers
found = (transformers.__version__, accelerate.__version__)
print(f"transformers=={found[0]} accelerate=={found[1]}")
sys.exit(0 if all(Version(f) == Version(w) for f, w in zip(found, sys.argv[1:])) else 1)
PYEOF
}
if ! on_path > /dev/null 2>&1; then
  rm -rf "$TARGET"
  "$PY" -m pip install -q --no-deps --target "$TARGET" "transformers==$TRANSFORMERS" "accelerate==$ACCELERATE"
  # The requirements of those releases that the environment does not meet (e.g. transformers 5.17
  # needs httpx, which later releases dropped) go into the same folder, with their own.
  missing=$("$PY" - "$TARGET" <<'PYEOF'
import importlib.metadata as md
import sys
from packaging.requirements import Requirement

target = sys.argv[1]
for name in ("transformers", "accelerate"):
    dist = next(md.distributions(name=name, path=[target]))
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            print(str(req))
PYEOF
)
  if [ -n "$missing" ]; then
    echo "oldest_hf_smoke: also installing into $TARGET: $(echo $missing)"
    # shellcheck disable=SC2086  # one requirement per line
    (IFS=$'\n'; "$PY" -m pip install -q --target "$TARGET" $missing)
  fi
fi
if ! seen=$(on_path); then
  echo "oldest_hf_smoke: expected transformers==$TRANSFORMERS accelerate==$ACCELERATE on the path, got $seen" >&2
  exit 1
fi
echo "oldest_hf_smoke: $seen (installed: $("$PY" -c "import transformers, accelerate; print(transformers.__version__, accelerate.__version__)"))"
PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
echo "oldest_hf_smoke: done in $((SECONDS - START)) s"
