# The installed torch, read off the Python that builds: TORCH_DIR, TORCH_CXX11_ABI, TORCH_CUDA_VERSION,
# TORCH_HIP_VERSION, TORCH_RUNTIME_LIBSTDCXX (the libstdc++ the process loads), TORCH_RUNTIME_OPENMP (the
# OpenMP runtime torch loads, empty without one), TORCH_CXX_STANDARD.
# Included by CMakeLists.txt (and by the toolchain test's project); sets CMAKE_CXX_STANDARD.
# Build against the torch that is installed in the running Python: its headers, its libraries, its
# C++ ABI. Nothing is downloaded.
find_package(Python REQUIRED COMPONENTS Interpreter)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or ''); print(torch.version.hip or ''); print(next((os.path.realpath(l.split()[-1]) for l in open('/proc/self/maps') if 'libstdc++' in l), '')); print(next((os.path.realpath(l.split()[-1]) for l in open('/proc/self/maps') if any(n in l for n in ('libgomp', 'libomp', 'libiomp'))), '')); print(20 if tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) >= (2, 13) else 17)"
  OUTPUT_VARIABLE _torch_info OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _torch_status)
if(NOT _torch_status EQUAL 0)
  # pip (by default), build and uv build in a fresh environment of their own, which cannot see the
  # installed torch; their temporary directories are on its path.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import sys; print(any(m in p for p in sys.path for m in ('build-env-', 'builds-v')))"
    OUTPUT_VARIABLE _isolated OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_isolated STREQUAL "True")
    message(FATAL_ERROR "fp8kv: this build runs in an isolated build environment, which cannot see the installed "
      "torch: install fp8kv without build isolation, as README.md says: python3 -m pip install "
      "\"scikit-build-core>=0.10\" \"cmake>=3.24\" ninja, then python3 -m pip install --no-build-isolation .")
  endif()
  message(FATAL_ERROR "fp8kv: could not import torch with ${Python_EXECUTABLE}; install torch first (README.md, Install)")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 TORCH_DIR)
list(GET _torch_info 1 TORCH_CXX11_ABI)
list(LENGTH _torch_info _n)
set(TORCH_CUDA_VERSION "")
set(TORCH_HIP_VERSION "")
if(_n GREATER 2)
  list(GET _torch_info 2 TORCH_CUDA_VERSION)
endif()
if(_n GREATER 3)
  list(GET _torch_info 3 TORCH_HIP_VERSION)
endif()
list(GET _torch_info -3 TORCH_RUNTIME_LIBSTDCXX)
list(GET _torch_info -2 TORCH_RUNTIME_OPENMP)
list(GET _torch_info -1 TORCH_CXX_STANDARD)
message(STATUS "fp8kv: torch at ${TORCH_DIR} (CUDA '${TORCH_CUDA_VERSION}', HIP '${TORCH_HIP_VERSION}', C++${TORCH_CXX_STANDARD})")

# The C++ standard torch's own extension builder uses (C++20 from torch 2.13, C++17 before): a
# different one can instantiate libstdc++ internals in this library that clash with the runtime's.
set(CMAKE_CXX_STANDARD ${TORCH_CXX_STANDARD})

