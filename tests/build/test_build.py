"""The library uses the C++ runtime of the process that loads it, so a raised error reaches Python.

A relocated GCC whose library directory holds only a static libstdc++.a used to copy a private,
uninitialized libstdc++ into the library: formatting any error message then crashed the process or
lost the text. The build links torch's runtime by path and proves the toolchain at configure time
(cmake/toolchain.cmake); these tests check the installed library and that configure-time proof.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import fp8kv._ops

REPO = pathlib.Path(__file__).resolve().parents[2]
CPP_RUNTIME_SYMBOLS = ("__cxa_throw", "__gxx_personality_v0")

RAISE_IN_CHILD = """
import torch, fp8kv
try:
    torch.ops.fp8kv.kv_amax(torch.zeros(2, 3), torch.zeros(2, 3, 4), torch.zeros(1), torch.zeros(1))
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


def test_op_error_reaches_python_with_its_message():
    child = subprocess.run([sys.executable, "-c", RAISE_IN_CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, f"the child died (status {child.returncode}): {child.stderr[-2000:]}"
    assert "`key` must have rank 3" in child.stdout and "got shape [2, 3]" in child.stdout, child.stdout


def _library_path() -> pathlib.Path:
    return pathlib.Path(fp8kv._ops.LIBRARY_PATH)


@pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("nm") is None, reason="needs binutils")
def test_library_links_the_shared_cpp_runtime():
    lib = _library_path()
    dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so.6]" in dynamic, f"{lib} does not link the shared libstdc++:\n{dynamic}"
    defined = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout.split()
    private = [s for s in CPP_RUNTIME_SYMBOLS if s in defined]
    assert not private, f"{lib} carries its own copy of the C++ runtime ({', '.join(private)})"


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils")
@pytest.mark.skipif("parallel backend: OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch splits work without OpenMP")
def test_cpu_kernels_split_work_with_torchs_openmp():
    """at::parallel_for is OpenMP pragmas compiled into the library: built without OpenMP, every CPU
    call ran on one thread whatever torch.set_num_threads said. The library calls the OpenMP runtime."""
    lib = _library_path()
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True,
                               check=True).stdout.split()
    assert any(s.startswith(("GOMP_parallel", "__kmpc_fork_call")) for s in undefined), \
        f"{lib} starts no OpenMP parallel region"


# ----------------------------------------------------------------------------- configure-time proof

PROBE_CALL = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.fp8kv_toolchain_probe.raise_formatted(7)
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


def _torch_flags() -> list[str]:
    torch_dir = pathlib.Path(torch.__file__).parent
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-isystem", str(torch_dir / "include"), "-isystem", str(torch_dir / "include/torch/csrc/api/include"),
            "-L", str(torch_dir / "lib"), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]


@pytest.fixture(scope="module")
def relocated_gcc(tmp_path_factory) -> pathlib.Path:
    """A g++ wrapper whose own library directory holds only libstdc++.a, like a relocated GCC."""
    gxx = shutil.which("g++")
    if gxx is None or shutil.which("cmake") is None:
        pytest.skip("needs g++ and cmake")
    static = pathlib.Path(subprocess.run([gxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True,
                                         check=True).stdout.strip())
    if not static.is_file():
        pytest.skip("g++ has no static libstdc++.a")
    root = tmp_path_factory.mktemp("relocated-gcc")
    shutil.copy(static, root / "libstdc++.a")
    wrapper = root / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec {gxx} -B{root}/ "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _probe_message(tmp_path: pathlib.Path, compiler: pathlib.Path, extra: list[str]) -> str:
    std = 20 if torch.__version__ >= "2.13" else 17
    probe = tmp_path / "probe.so"
    subprocess.run([str(compiler), f"-std=c++{std}", "-O2", "-fPIC", "-shared", str(REPO / "cmake/toolchain_probe.cpp"),
                    "-o", str(probe), *_torch_flags(), *extra], check=True, capture_output=True, timeout=600)
    child = subprocess.run([sys.executable, "-c", PROBE_CALL, str(probe)], capture_output=True, text=True, timeout=120)
    return f"status {child.returncode}: {child.stdout.strip()}"


def _configure(tmp_path: pathlib.Path, compiler: pathlib.Path) -> subprocess.CompletedProcess:
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.24)\nproject(fp8kv_toolchain_test LANGUAGES CXX)\n"
        f'include("{REPO}/cmake/torch.cmake")\ninclude("{REPO}/cmake/toolchain.cmake")\n')
    return subprocess.run(["cmake", "-S", str(project), "-B", str(tmp_path / "build"),
                           f"-DCMAKE_CXX_COMPILER={compiler}", f"-DPython_EXECUTABLE={sys.executable}"],
                          capture_output=True, text=True, timeout=900)


def test_relocated_gcc_reproduces_the_lost_error(tmp_path, relocated_gcc):
    # Without the runtime linked by path, the wrapper copies libstdc++.a in and the message is lost
    # (or the process crashes): the hazard the build guards against is real on this machine.
    assert _probe_message(tmp_path, relocated_gcc, []) != "status 0: probe: 7 != 8 (0.5)"


def test_configure_accepts_relocated_gcc_by_linking_the_runtime(tmp_path, relocated_gcc):
    configured = _configure(tmp_path, relocated_gcc)
    assert configured.returncode == 0, configured.stdout[-3000:] + configured.stderr[-3000:]
    assert "an operator's error reaches Python as RuntimeError" in configured.stdout


def test_configure_refuses_a_toolchain_that_loses_errors(tmp_path, relocated_gcc):
    # A compiler that flips the C++ ABI builds a library torch cannot call: the probe must refuse it.
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    wrapper = tmp_path / "wrong-abi-g++"
    wrapper.write_text(f'#!/bin/sh\nexec {relocated_gcc} "$@" -U_GLIBCXX_USE_CXX11_ABI -D_GLIBCXX_USE_CXX11_ABI={1 - abi}\n')
    wrapper.chmod(0o755)
    configured = _configure(tmp_path, wrapper)
    assert configured.returncode != 0
    assert "crashes or loses its error when an operator raises" in configured.stderr, configured.stderr[-3000:]
