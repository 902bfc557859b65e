// Element types, the values each kernel family supports, and the one compile-time dispatch over them.
//
// Framework-free (no torch): included by the op bindings, the CPU kernels and the CUDA and HIP
// kernels alike. A backend turns a run-time value (a dtype, a head size) into a compile-time one with
// `dispatch<kSupported>(value, unsupported, fn)`, which calls fn with the matching constant and
// returns `unsupported` (the backend's error value) for a value outside the list.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

// Functions of the framework-free layer compile for the host and, under nvcc or hipcc, the device.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define FP8KV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FP8KV_HOST_DEVICE inline
#endif

namespace fp8kv {

enum class DType : int {
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat8E4M3FN,
  kFloat8E5M2,
  kFloat8E4M3FNUZ,
};

// A dtype as a type (what `dispatch` passes): decltype(tag)::value is the DType.
template <DType T>
using DTypeTag = std::integral_constant<DType, T>;

constexpr bool is_fp8(DType t) {
  return t == DType::kFloat8E4M3FN || t == DType::kFloat8E5M2 || t == DType::kFloat8E4M3FNUZ;
}

constexpr int dtype_bytes(DType t) { return t == DType::kFloat32 ? 4 : is_fp8(t) ? 1 : 2; }

// torch's name of the dtype, for error messages.
constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat8E4M3FN: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kFloat8E4M3FNUZ: return "float8_e4m3fnuz";
  }
  return "?";
}

// ---- what the kernels support ------------------------------------------------------------------

// key / value of the cache write and kv_amax.
inline constexpr DType kSourceDTypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
// query / out of paged attention.
inline constexpr DType kQueryDTypes[] = {DType::kFloat16, DType::kBFloat16};
inline constexpr DType kFp8DTypes[] = {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat8E4M3FNUZ};
// Caches paged attention reads: FP8, or unquantized in the query's dtype.
inline constexpr DType kAttentionCacheDTypes[] = {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat8E4M3FNUZ,
                                                 DType::kFloat16, DType::kBFloat16};
// The CUDA paged-attention kernels: compiled per head size; block sizes are powers of two (the
// kernels split positions with shifts and masks).
inline constexpr int kCudaHeadSizes[] = {64, 80, 96, 128, 192, 256};
inline constexpr int kCudaBlockSizes[] = {8, 16, 32, 64, 128, 256};
// The sm_90a multi-token kernel (warpgroup MMAs): its head sizes (multiples of the 64-element swizzle
// row; above 128 the query is staged in shared memory) and the compute capability its code runs on.
inline constexpr int kCudaSm90aHeadSizes[] = {64, 128, 256};
// Its FP8-math variant (`fp8_math`): e4m3fn and e5m2 caches, these head sizes (at 256, O and its
// partial sums would take every register).
inline constexpr int kCudaSm90aFp8MathHeadSizes[] = {64, 128};
inline constexpr DType kCudaFp8MathDTypes[] = {DType::kFloat8E4M3FN, DType::kFloat8E5M2};
inline constexpr int kCudaSm90aCapability[] = {9, 0};
// The most sequences of a multi-token call the CUDA decode kernel takes (its CTAs stage a table of
// them in shared memory); calls of more take the multi-token kernels.
inline constexpr int kCudaDecodeTableSeqs[] = {1024};

template <typename T, std::size_t N>
constexpr bool contains(const T (&values)[N], T value) {
  for (const T& v : values) {
    if (v == value) return true;
  }
  return false;
}

// "64, 80, 96", or with `last` before the last value "float16, bfloat16 or float32", for error messages.
template <typename T, std::size_t N>
std::string format_list(const T (&values)[N], const char* last = ", ") {
  std::string text;
  for (std::size_t i = 0; i < N; ++i) {
    text += i == 0 ? "" : i + 1 == N ? last : ", ";
    if constexpr (std::is_same_v<T, DType>) {
      text += dtype_name(values[i]);
    } else {
      text += std::to_string(values[i]);
    }
  }
  return text;
}

// ---- dispatch ----------------------------------------------------------------------------------

namespace detail {

template <const auto& kValues, typename Value, typename Result, typename Fn, std::size_t... I>
Result dispatch(Value value, Result unsupported, Fn& fn, std::index_sequence<I...>) {
  using Element = std::remove_cv_t<std::remove_reference_t<decltype(kValues[0])>>;
  Result result = unsupported;
  // One comparison per supported value, in order; fn is instantiated for each.
  (void)((value == kValues[I] ? (result = fn(std::integral_constant<Element, kValues[I]>{}), true) : false) || ...);
  return result;
}

}  // namespace detail

// fn(std::integral_constant<..., v>{}) for the v of kValues equal to `value`; `unsupported` if none is.
template <const auto& kValues, typename Value, typename Result, typename Fn>
Result dispatch(Value value, Result unsupported, Fn&& fn) {
  constexpr std::size_t kCount = sizeof(kValues) / sizeof(kValues[0]);
  return detail::dispatch<kValues>(value, unsupported, fn, std::make_index_sequence<kCount>{});
}

}  // namespace fp8kv
