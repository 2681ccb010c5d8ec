#!/usr/bin/env bash
# Run HERE (a machine with network), before a GPU call that runs DeepSpeed's rows of
# bench/train_bench.py: the GPU machine has no network, so DeepSpeed travels with the working tree.
# Downloads into .whl/ (git-ignored; carry it with the call: `carry: [".whl"]`, 64 MiB at most):
#   - the DeepSpeed sdist (DS_VERSION, default 0.19.8; the GPU side builds it with DS_BUILD_OPS=0, so
#     its CUDA ops are compiled just in time on first use, as DeepCompile's op library is);
#   - wheels of what DeepSpeed's install_requires needs beyond torch and numpy (which every torch
#     environment has), for the GPU machine's Python (PY_VERSION, default 3.12) on manylinux x86_64:
#     pinned where an older copy there would not do (pydantic 2.14.4 needs its exact pydantic-core).
#   - setuptools and wheel, which build the sdist (it has no pyproject.toml).
# The GPU side installs with scripts/gpu_deepspeed.sh (`pip install --no-index --find-links .whl`);
# pip takes an installed package over a wheel here whenever the installed one satisfies the pin.
set -euo pipefail
cd "$(dirname "$0")/.."
DS_VERSION=${DS_VERSION:-0.19.8}
PY_VERSION=${PY_VERSION:-3.12}
DEST=${DEST:-.whl}
mkdir -p "$DEST"

# The sdist, never a wheel: DeepSpeed publishes none, and the build must happen on the GPU machine
# (its setup.py looks at the torch and accelerator it finds).
python3 -m pip download -q --no-deps --no-binary=:all: -d "$DEST" "deepspeed==$DS_VERSION"

# --no-deps: only the names listed (their own dependencies are in the list or in every torch +
# transformers environment); --only-binary with an explicit target, so nothing is built here.
WHEELS=(
  hjson "pydantic==2.14.4" "pydantic-core==2.50.5" annotated-types typing-inspection "typing_extensions>=4.16"
  ninja py-cpuinfo msgpack nvidia-ml-py einops psutil packaging tqdm
  setuptools wheel
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}"

# TRL and its datasets dependency for the served TRL tests on the GPU machine (its image has
# Lightning and PEFT but neither of these): into $DEST/hf, installed there by gpu_install_hf_extras
# (scripts/gpu_prelude.sh) with `python3 -m pip install --no-index --no-deps`.
mkdir -p "$DEST/hf"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux2014_x86_64 -d "$DEST/hf" \
  "trl==${TRL_VERSION:-1.16.0}" "datasets==${DATASETS_VERSION:-5.2.0}" "dill==0.4.1" "multiprocess==0.70.19"

ls -1 "$DEST" "$DEST/hf"
size_kib=$(du -sk "$DEST" | cut -f1)
echo "$DEST: $(( size_kib / 1024 )) MiB (the carry limit is 64 MiB for everything carried)"
if [ "$size_kib" -gt $(( 48 * 1024 )) ]; then
  echo "warning: $DEST is over 48 MiB; remove older downloads from it before carrying" >&2
fi
