# C++ runtime and toolchain checks, included by CMakeLists.txt once torch is found and the compiler is
# known. Sets FP8KV_CXX_RUNTIME_LINK: what the library must link to use torch's C++ runtime.
#
# torch links the system libstdc++ (TORCH_RUNTIME_LIBSTDCXX, read off the running Python). This library
# must use that same copy. A compiler whose own library directory holds only a static libstdc++.a (a
# relocated GCC installation, for instance) would otherwise copy a second libstdc++ into this library:
# its stream and locale state is never initialized, so formatting any error message crashes the
# process. Linking the runtime by path, ahead of the compiler's implicit -lstdc++, resolves every C++
# runtime symbol from it.
set(FP8KV_CXX_RUNTIME_LINK "")
if(TORCH_RUNTIME_LIBSTDCXX)
  set(FP8KV_CXX_RUNTIME_LINK "${TORCH_RUNTIME_LIBSTDCXX}")
endif()

# Code compiled against newer libstdc++ headers than the runtime the Python process loads can call
# symbols that runtime lacks or lays out differently: refuse such a compiler up front.
execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libstdc++.so.6
                OUTPUT_VARIABLE _compiler_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
get_filename_component(_compiler_libstdcxx "${_compiler_libstdcxx}" REALPATH)
string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+$" _compiler_libstdcxx_version "${_compiler_libstdcxx}")
string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+$" _runtime_libstdcxx_version "${TORCH_RUNTIME_LIBSTDCXX}")
if(_compiler_libstdcxx_version AND _runtime_libstdcxx_version AND
   _compiler_libstdcxx_version VERSION_GREATER _runtime_libstdcxx_version)
  message(FATAL_ERROR "fp8kv: ${CMAKE_CXX_COMPILER} ships libstdc++ ${_compiler_libstdcxx_version}, newer than "
          "the libstdc++ ${_runtime_libstdcxx_version} torch runs with (${TORCH_RUNTIME_LIBSTDCXX}); set CXX and "
          "CUDAHOSTCXX to an older g++ (e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++).")
endif()

# Proof: build a one-op library with this compiler against the installed torch, load it in a fresh
# Python and call it. The toolchain is accepted only if the op's error arrives as a RuntimeError.
# The verdict is cached per compiler, torch and runtime, so re-configuring does not rebuild the probe.
set(_probe_key "${CMAKE_CXX_COMPILER}|${TORCH_DIR}|${TORCH_RUNTIME_LIBSTDCXX}|${TORCH_CXX_STANDARD}")
if(NOT FP8KV_TOOLCHAIN_PROBED STREQUAL _probe_key)
  message(STATUS "fp8kv: building and loading a one-op probe library with ${CMAKE_CXX_COMPILER} (once per "
          "compiler and torch; about half a minute)")
  set(_probe_dir "${CMAKE_BINARY_DIR}/toolchain_probe")
  file(MAKE_DIRECTORY "${_probe_dir}")
  execute_process(
    COMMAND "${CMAKE_CXX_COMPILER}" -std=c++${TORCH_CXX_STANDARD} -O2 -fPIC -shared
            -D_GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI}
            -isystem "${TORCH_DIR}/include" -isystem "${TORCH_DIR}/include/torch/csrc/api/include"
            "${CMAKE_CURRENT_LIST_DIR}/toolchain_probe.cpp" -o "${_probe_dir}/probe.so"
            -L "${TORCH_DIR}/lib" -lc10 -ltorch_cpu ${FP8KV_CXX_RUNTIME_LINK} "-Wl,-rpath,${TORCH_DIR}/lib"
    RESULT_VARIABLE _probe_build OUTPUT_VARIABLE _probe_log ERROR_VARIABLE _probe_log)
  file(WRITE "${_probe_dir}/build.log" "${_probe_log}")
  if(NOT _probe_build EQUAL 0)
    message(FATAL_ERROR "fp8kv: ${CMAKE_CXX_COMPILER} cannot build a torch operator library (log: "
            "${_probe_dir}/build.log); set CXX and CUDAHOSTCXX to a working g++ (e.g. /usr/bin/g++).")
  endif()
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import sys, torch\ntorch.ops.load_library(sys.argv[1])\ntry:\n    torch.ops.fp8kv_toolchain_probe.raise_formatted(7)\nexcept RuntimeError as e:\n    sys.exit(0 if str(e).startswith('probe: 7 != 8 (0.5)') else 3)\nsys.exit(4)"
      "${_probe_dir}/probe.so"
    RESULT_VARIABLE _probe_run OUTPUT_VARIABLE _probe_out ERROR_VARIABLE _probe_out)
  if(NOT _probe_run STREQUAL "0")
    message(FATAL_ERROR "fp8kv: a library built with ${CMAKE_CXX_COMPILER} crashes or loses its error when an "
            "operator raises (probe exit: ${_probe_run}); set CXX and CUDAHOSTCXX to a g++ that links the system "
            "libstdc++ (e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++).")
  endif()
  set(FP8KV_TOOLCHAIN_PROBED "${_probe_key}" CACHE INTERNAL "toolchain whose raised errors reach Python")
  message(STATUS "fp8kv: ${CMAKE_CXX_COMPILER}: an operator's error reaches Python as RuntimeError")
endif()
