# ROCm build: included by CMakeLists.txt when the installed torch is a ROCm build (torch.version.hip),
# before the library target exists. Adds the HIP kernels to FP8KV_SOURCES and defines
# fp8kv_link_hip(target), which CMakeLists.txt calls once the target exists.
#
# Needs a ROCm toolkit (its clang as the HIP compiler, found through ROCM_PATH or /opt/rocm).
# PYTORCH_ROCM_ARCH (torch's spelling: "gfx90a;gfx942", spaces or semicolons) picks the GPU
# architectures; the default covers MI200 (gfx90a) and MI300 (gfx942). The kernels assume 64-lane
# wavefronts, i.e. CDNA parts.

set(_rocm_path "$ENV{ROCM_PATH}")
if(_rocm_path STREQUAL "")
  set(_rocm_path "/opt/rocm")
endif()
list(APPEND CMAKE_PREFIX_PATH "${_rocm_path}" "${_rocm_path}/lib/cmake")

# Only CDNA (gfx9*) targets have the 64-lane wavefronts the kernels are written for.
set(_cdna_pattern "^gfx9[0-9a-f]+(:[a-z]+[+-])*$")
string(REGEX REPLACE "[ ,]+" ";" _hip_archs "$ENV{PYTORCH_ROCM_ARCH}")
if(NOT _hip_archs)
  set(_hip_archs gfx90a gfx942)
endif()
set(_cdna_archs ${_hip_archs})
list(FILTER _cdna_archs INCLUDE REGEX "${_cdna_pattern}")
set(_other_archs ${_hip_archs})
list(FILTER _other_archs EXCLUDE REGEX "${_cdna_pattern}")
if(_other_archs)
  message(WARNING "fp8kv: skipping PYTORCH_ROCM_ARCH entries '${_other_archs}': the HIP kernels need CDNA (gfx9*) "
                  "targets with 64-lane wavefronts")
endif()
if(NOT _cdna_archs)
  message(FATAL_ERROR "fp8kv: no CDNA (gfx9*) target in PYTORCH_ROCM_ARCH='${_hip_archs}'")
endif()
set(CMAKE_HIP_ARCHITECTURES "${_cdna_archs}")
set(CMAKE_HIP_STANDARD 17)
set(CMAKE_HIP_STANDARD_REQUIRED ON)

enable_language(HIP)
find_package(hip REQUIRED CONFIG)
message(STATUS "fp8kv: HIP kernels (torch HIP '${TORCH_HIP_VERSION}', hip ${hip_VERSION}) for ${CMAKE_HIP_ARCHITECTURES}")

# The kernels and launchers (framework-free) and the GPU registrations (shared with CUDA).
file(GLOB _hip_sources CONFIGURE_DEPENDS "${CMAKE_CURRENT_LIST_DIR}/../csrc/hip/*.hip"
     "${CMAKE_CURRENT_LIST_DIR}/../csrc/gpu/*.cpp")
list(APPEND FP8KV_SOURCES ${_hip_sources})

function(fp8kv_link_hip target)
  # USE_ROCM and __HIP_PLATFORM_AMD__ as torch's own extension builds set them for its ROCm headers.
  target_compile_definitions(${target} PRIVATE FP8KV_WITH_HIP USE_ROCM=1 __HIP_PLATFORM_AMD__=1)
  # Plain -O3: no fast-math, so fp32 division stays correctly rounded (the cache bytes must equal
  # the CPU backend's).
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:HIP>:-O3>)
  set_target_properties(${target} PROPERTIES HIP_ARCHITECTURES "${CMAKE_HIP_ARCHITECTURES}")
  target_link_libraries(${target} PRIVATE c10_hip torch_hip hip::host)
endfunction()
