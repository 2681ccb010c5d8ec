#!/usr/bin/env bash
# A digest of the sources that decide what runs on a GPU (C++/CUDA, the Python package, bench,
# tests), independent of git metadata: the device machine's copy of .git can be stale, so runs
# record this digest and a local `bash scripts/source_digest.sh` on a commit tells which tree ran.
set -euo pipefail
cd "$(dirname "$0")/.."
find csrc deepcompile bench tests -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.py' \) \
  -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
