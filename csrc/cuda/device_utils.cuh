// Small device helpers shared by the CUDA kernels: vector loads, tensor-core fragments, FP8 pair
// conversion, element types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../fp8.h"
#include "../kernel_params.h"

namespace fp8kv::cuda {

// ---- loads ---------------------------------------------------------------------------------

// Loads kBytes (2, 4, 8 or 16) from global or shared memory into 32-bit words (2 bytes: into the
// low half).
template <int kBytes>
__device__ __forceinline__ void load_words(const void* ptr, uint32_t* dst) {
  if constexpr (kBytes == 16) {
    const uint4 v = *static_cast<const uint4*>(ptr);
    dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = *static_cast<const uint2*>(ptr);
    dst[0] = v.x, dst[1] = v.y;
  } else if constexpr (kBytes == 4) {
    dst[0] = *static_cast<const unsigned int*>(ptr);
  } else {
    static_assert(kBytes == 2, "unsupported load width");
    dst[0] = *static_cast<const unsigned short*>(ptr);
  }
}

// Asynchronous global -> shared copy of kBytes (4, 8 or 16); zero-fills when `valid` is false
// (nothing is read then).
template <int kBytes>
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem), "n"(kBytes), "r"(src_bytes)
                 : "memory");
  }
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and when the launch did not ask for it):
// a grid lets the next grid in its stream start its CTAs, which then wait for it to finish.
__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Largest power-of-two vector width (bytes, at most 16) that divides `bytes`.
constexpr int vector_bytes(int bytes) {
  return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 2;
}

// ---- tensor cores --------------------------------------------------------------------------

// D = A (16x16, row) * B (16x8, col) + D, fp32 accumulators; A and B hold fp16 or bf16 pairs.
template <bool kBf16>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Loads four 8x8 matrices of 16-bit values from shared memory in mma fragment layout: lanes
// 8m .. 8m + 7 give the addresses of matrix m's rows; register m receives matrix m.
__device__ __forceinline__ void load_matrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// As load_matrix_x4, each matrix transposed.
__device__ __forceinline__ void load_matrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// Transposes the warp's 8x8 matrix of 16-bit values held in mma fragment layout.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Two floats -> packed pair (lo in the low half), round to nearest even.
template <bool kBf16>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t r;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  return __byte_perm(a, b, selector);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- element types ---------------------------------------------------------------------------

enum class CacheKind { kE4M3FN, kE5M2, kE4M3FNUZ, kFloat16, kBFloat16 };

template <CacheKind C>
struct CacheTraits {
  static constexpr bool kIsFp8 = C == CacheKind::kE4M3FN || C == CacheKind::kE5M2 || C == CacheKind::kE4M3FNUZ;
  static constexpr int kElemBytes = kIsFp8 ? 1 : 2;
  // Tensor-core operand type: fp16 for FP8 caches (every FP8 value is exact in fp16).
  static constexpr bool kBf16Math = C == CacheKind::kBFloat16;
};

// Converts the FP8 bytes (b0, b1) and (b2, b3) of `w` into two fp16 pairs holding the values times
// fp8_decode_factor<C>() (folded into the scales by the caller).
template <CacheKind C>
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi);

// The power of two by which fp8x4_to_half2x2 divides the FP8 values (1 where conversion is exact).
template <CacheKind C>
__device__ __forceinline__ float fp8_decode_factor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (C == CacheKind::kE4M3FN || C == CacheKind::kE5M2) return 1.0f;
#endif
  if constexpr (C == CacheKind::kE4M3FN) return 256.0f;   // bias 7 read with fp16's bias 15
  if constexpr (C == CacheKind::kE4M3FNUZ) return 128.0f;  // bias 8 read with fp16's bias 15
  return 1.0f;                                             // e5m2 is the top byte of an fp16
}

namespace detail {

// Nonzero iff some byte of v is zero.
__device__ __forceinline__ uint32_t has_zero_byte(uint32_t v) { return (v - 0x01010101u) & ~v & 0x80808080u; }

// fp16 bits of sign | (magnitude << 7): the e4m3 value times 2^(bias - 15).
__device__ __forceinline__ void e4m3_bits_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t x0 = byte_perm(w, 0u, 0x1404u);  // [0, b0, 0, b1]
  const uint32_t x1 = byte_perm(w, 0u, 0x3424u);  // [0, b2, 0, b3]
  lo = (x0 & 0x80008000u) | ((x0 >> 1) & 0x3F803F80u);
  hi = (x1 & 0x80008000u) | ((x1 >> 1) & 0x3F803F80u);
}

template <CacheKind C>
__device__ __noinline__ void patch_nan_codes(uint32_t w, uint32_t& lo, uint32_t& hi) {
  uint32_t halves[2] = {lo, hi};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t code = (w >> (8 * i)) & 0xFFu;
    const bool nan = C == CacheKind::kE4M3FNUZ ? code == 0x80u : (code & 0x7Fu) == 0x7Fu;
    if (nan) halves[i / 2] |= 0x7E00u << (16 * (i % 2));
  }
  lo = halves[0], hi = halves[1];
}

}  // namespace detail

template <CacheKind C>
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  static_assert(CacheTraits<C>::kIsFp8, "FP8 caches only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (C == CacheKind::kE4M3FN || C == CacheKind::kE5M2) {
    const uint16_t w0 = static_cast<uint16_t>(w), w1 = static_cast<uint16_t>(w >> 16);
    if constexpr (C == CacheKind::kE4M3FN) {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(lo) : "h"(w0));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(hi) : "h"(w1));
    } else {
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(lo) : "h"(w0));
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(hi) : "h"(w1));
    }
    return;
  }
#endif
  if constexpr (C == CacheKind::kE5M2) {
    lo = byte_perm(w, 0u, 0x1404u);
    hi = byte_perm(w, 0u, 0x3424u);
  } else {
    detail::e4m3_bits_to_half2x2(w, lo, hi);
    // NaN codes (0x80 in fnuz; 0x7F/0xFF in e4m3fn) would otherwise read as finite values.
    const uint32_t nan_probe = C == CacheKind::kE4M3FNUZ ? (w ^ 0x80808080u) : ((w & 0x7F7F7F7Fu) ^ 0x7F7F7F7Fu);
    if (detail::has_zero_byte(nan_probe)) detail::patch_nan_codes<C>(w, lo, hi);
  }
}

// Query / output element type, chosen at run time (it is touched once per CTA).
__device__ __forceinline__ float2 load_pair_as_float2(const void* ptr, bool bf16) {
  const uint32_t bits = *static_cast<const uint32_t*>(ptr);
  if (bf16) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

__device__ __forceinline__ void store_pair_from_float2(void* ptr, float lo, float hi, bool bf16) {
  if (bf16) {
    *static_cast<__nv_bfloat162*>(ptr) = __floats2bfloat162_rn(lo, hi);
  } else {
    *static_cast<__half2*>(ptr) = __floats2half2_rn(lo, hi);
  }
}

}  // namespace fp8kv::cuda
