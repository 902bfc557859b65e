#!/usr/bin/env bash
# Developer install: editable (Python edits are live), incremental C++ rebuild. Serialized with a
# lock so several people working in one tree never run two builds in one build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 9>/tmp/fp8kv-build.lock
flock 9
python3 -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 \
  | { grep -v -e "^WARNING: Location" -e "Running pip as the 'root' user" || true; }
