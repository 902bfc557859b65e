// Device building blocks shared by the CUDA kernels: loads and asynchronous copies, dependent
// launch, tensor-core fragments, FP8 conversion, cache element types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../dispatch.h"
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

// Four floats -> four e4m3fn bytes (a in the lowest), round to nearest even, saturated to +-448: the
// FP8-math kernel's operand registers.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- block-wide scan ---------------------------------------------------------------------------

// Exclusive prefix sum of `value` over the CTA's kCtaThreads threads (in thread order); `total` gets
// the sum over all of them. Called by every thread; `warp_totals` holds kCtaThreads / 32 ints of
// shared memory, which the caller must not rewrite (the next call) before a __syncthreads().
template <int kCtaThreads>
__device__ __forceinline__ int block_exclusive_scan(int value, int* warp_totals, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int exclusive = inclusive - value;
  total = 0;
#pragma unroll
  for (int x = 0; x < kCtaThreads / 32; ++x) {
    if (x < warp) exclusive += warp_totals[x];
    total += warp_totals[x];
  }
  return exclusive;
}

// ---- element types ---------------------------------------------------------------------------

template <DType C>
struct CacheTraits {
  static constexpr bool kIsFp8 = is_fp8(C);
  static constexpr int kElemBytes = dtype_bytes(C);
  // Tensor-core operand type: fp16 for FP8 caches (every FP8 value is exact in fp16).
  static constexpr bool kBf16Math = C == DType::kBFloat16;
};

// The power of two by which convert_fp8x4 divides the FP8 values (1 where conversion is exact).
template <DType C>
__device__ __forceinline__ float fp8_decode_factor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (C == DType::kFloat8E4M3FN || C == DType::kFloat8E5M2) return 1.0f;
#endif
  return fp8_half_scale<C>();
}

// Converts the FP8 bytes (b0, b1) and (b2, b3) of `w` into two fp16 pairs holding the values divided
// by fp8_decode_factor<C>() (folded into the scales by the caller): the hardware conversion on sm_89+
// where it exists, else the shared bit move.
template <DType C>
__device__ __forceinline__ void convert_fp8x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  static_assert(CacheTraits<C>::kIsFp8, "FP8 caches only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (C == DType::kFloat8E4M3FN || C == DType::kFloat8E5M2) {
    const uint16_t w0 = static_cast<uint16_t>(w), w1 = static_cast<uint16_t>(w >> 16);
    if constexpr (C == DType::kFloat8E4M3FN) {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(lo) : "h"(w0));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(hi) : "h"(w1));
    } else {
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(lo) : "h"(w0));
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(hi) : "h"(w1));
    }
    return;
  }
#endif
  fp8x4_to_half2x2<C>(w, lo, hi);
}

// Query / output element type, chosen at run time (it is touched once per CTA).
__device__ __forceinline__ float2 pair_as_float2(uint32_t bits, bool bf16) {
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
