// The CPU attention's arithmetic on fp32 tiles, in vectors of W floats (GCC / Clang vector extensions):
// a register-blocked matrix product and exp. Everything here is inlined into its caller, whose target
// (the baseline ISA, or AVX2 / AVX-512 chosen at run time: paged_attention.cpp) picks the instructions.
//
// Each output element's arithmetic is the same wherever it lies in a tile and however many rows the
// tile has (each product is summed in k order, exp works lane by lane), so a query row's result does not
// depend on the rows computed with it: a request gives the same bits alone, batched with others or
// prefilled in chunks. A BLAS product does not promise that (its blocking follows the matrix sizes).
#pragma once

#include <cstdint>
#include <cstring>

#define FP8KV_ALWAYS_INLINE inline __attribute__((always_inline))

namespace fp8kv::cpu {

// Vectors of AVX's widths pass by value between these functions, which never cross an ABI boundary
// (all are inlined), whatever ISA the including file is compiled for.
#pragma GCC diagnostic ignored "-Wpsabi"

template <int W>
struct Simd {
  // typedef, not `using`: GCC drops a vector_size that depends on a template parameter from an alias.
  typedef float Vec __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t Int __attribute__((vector_size(W * sizeof(float))));

  static FP8KV_ALWAYS_INLINE Vec load(const float* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static FP8KV_ALWAYS_INLINE void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }
  // x's bits added to integer zeros: a broadcast and nothing else (`Vec{} + x` adds 0.0f first, which
  // may not be folded away: it turns -0 into +0).
  static FP8KV_ALWAYS_INLINE Vec splat(float x) { return bit_cast<Vec>(Int{} + bit_cast<int32_t>(x)); }
  template <typename To, typename From>
  static FP8KV_ALWAYS_INLINE To bit_cast(const From& from) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To to;
    std::memcpy(&to, &from, sizeof to);
    return to;
  }
  // The lanes reduced in lane order (a fixed order: see above).
  template <typename Op>
  static FP8KV_ALWAYS_INLINE float reduce(const Vec& v, float init, Op op) {
    float lanes[W];
    std::memcpy(lanes, &v, sizeof lanes);
    for (int lane = 0; lane < W; ++lane) init = op(init, lanes[lane]);
    return init;
  }
};

// e^x lane by lane for x <= 0, as Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so
// r is exact), e^r by a degree-7 polynomial, 2^n through the exponent bits. Within 2 ulp of e^x; x <= -88
// (e^x below fp32's normal range, -inf included) gives 0, NaN stays NaN.
template <int W>
FP8KV_ALWAYS_INLINE void exp_nonpositive(float* x) {
  using S = Simd<W>;
  using Vec = typename S::Vec;
  using Int = typename S::Int;
  Vec v = S::load(x);
  v = v < S::splat(-88.0f) ? S::splat(-88.0f) : v;
  const Vec shifter = S::splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const Vec t = v * 1.44269504088896341f + shifter;
  const Vec n = t - shifter;
  const Vec r = (v - n * 0.693359375f) - n * -2.12194440e-4f;
  Vec poly = S::splat(1.9875691500e-4f);
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const Vec e_r = (poly * r * r + r) + 1.0f;
  // n = bits(t) - bits(shifter); n = -127 gives the bits of 0.
  const Int exponent = ((S::template bit_cast<Int>(t) - S::template bit_cast<Int>(shifter)) + 127) << 23;
  S::store(x, e_r * S::template bit_cast<Vec>(exponent));
}

// The product's register block: kProductRows rows by kProductVectors vectors of columns.
inline constexpr int kProductRows = 6;
inline constexpr int kProductVectors = 2;

// C[r][j] (kAccumulate: +)= sum over k in [k_begin, k_end) of A[r][k] * B[k][j], summed in k order, for
// r < Rows and j < kProductVectors * W. A, B and C are row-major with strides lda, ldb, ldc.
template <int W, int Rows, bool kAccumulate>
FP8KV_ALWAYS_INLINE void product_block(int k_begin, int k_end, const float* a, int64_t lda, const float* b, int64_t ldb,
                                       float* c, int64_t ldc) {
  using S = Simd<W>;
  typename S::Vec acc[Rows][kProductVectors];
  for (int r = 0; r < Rows; ++r) {
    for (int v = 0; v < kProductVectors; ++v) acc[r][v] = kAccumulate ? S::load(c + r * ldc + v * W) : S::splat(0.0f);
  }
  for (int k = k_begin; k < k_end; ++k) {
    typename S::Vec row[kProductVectors];
    for (int v = 0; v < kProductVectors; ++v) row[v] = S::load(b + k * ldb + v * W);
    for (int r = 0; r < Rows; ++r) {
      const auto scalar = S::splat(a[r * lda + k]);
      for (int v = 0; v < kProductVectors; ++v) acc[r][v] += scalar * row[v];
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int v = 0; v < kProductVectors; ++v) S::store(c + r * ldc + v * W, acc[r][v]);
  }
}

// product_block over columns [0, cols) (a multiple of kProductVectors * W) for rows <= kProductRows.
template <int W, bool kAccumulate>
FP8KV_ALWAYS_INLINE void product_rows(int rows, int cols, int k_begin, int k_end, const float* a, int64_t lda,
                                      const float* b, int64_t ldb, float* c, int64_t ldc) {
  static_assert(kProductRows == 6, "one case per row count");
  for (int j = 0; j < cols; j += kProductVectors * W) {
    switch (rows) {
      case 6: product_block<W, 6, kAccumulate>(k_begin, k_end, a, lda, b + j, ldb, c + j, ldc); break;
      case 5: product_block<W, 5, kAccumulate>(k_begin, k_end, a, lda, b + j, ldb, c + j, ldc); break;
      case 4: product_block<W, 4, kAccumulate>(k_begin, k_end, a, lda, b + j, ldb, c + j, ldc); break;
      case 3: product_block<W, 3, kAccumulate>(k_begin, k_end, a, lda, b + j, ldb, c + j, ldc); break;
      case 2: product_block<W, 2, kAccumulate>(k_begin, k_end, a, lda, b + j, ldb, c + j, ldc); break;
      default: product_block<W, 1, kAccumulate>(k_begin, k_end, a, lda, b + j, ldb, c + j, ldc); break;
    }
  }
}

}  // namespace fp8kv::cpu
