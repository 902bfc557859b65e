// The rotation of the rotated cache recipe (docs/rotated_cache.md): a block-diagonal Hadamard
// matrix over the head dimension. Framework-free. Every backend applies the same butterflies in the
// same order, in fp32, so that they store the same bytes.
#pragma once

#include "dispatch.h"

namespace fp8kv {

// The blocks' size: the largest power of two that divides the head size, at most kMaxHadamardBlock
// (a larger block would spread energy no better and cost the kernels registers).
inline constexpr int kMaxHadamardBlock = 256;
FP8KV_HOST_DEVICE constexpr int hadamard_block(int head_size) {
  return (head_size & -head_size) < kMaxHadamardBlock ? head_size & -head_size : kMaxHadamardBlock;
}

// Smaller blocks would leave most of an outlier channel in place; the ops refuse them.
inline constexpr int kMinHadamardBlock = 16;

// 1/sqrt(block) rounded to fp32, for a power-of-two block: a power of two, or one times fp32(1/sqrt(2)).
FP8KV_HOST_DEVICE constexpr float hadamard_norm(int block) {
  float norm = 1.0f;
  for (; block >= 4; block /= 4) norm *= 0.5f;
  return block == 2 ? norm * 0.70710678118654752440f : norm;
}

// x * y rounded once: the rotated write's normalization must not fuse with the subtraction after it.
FP8KV_HOST_DEVICE float mul_rn(float x, float y) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fmul_rn(x, y);
#else
  return x * y;  // the host build turns contraction off (CMakeLists.txt)
#endif
}

// One butterfly of the transform: (a, b) becomes (a + b, a - b), each rounded once.
FP8KV_HOST_DEVICE void butterfly(float& a, float& b) {
  const float sum = a + b;
  b = a - b;
  a = sum;
}

// The unnormalized transform of each block of `block` consecutive elements of x[0, n), in place:
// for h = 1, 2, ..., block / 2, every pair (x[i], x[i + h]) with i & h == 0 becomes
// (x[i] + x[i + h], x[i] - x[i + h]). The order of h is part of the contract (rounding).
inline void hadamard_blocks(float* x, int n, int block) {
  for (int h = 1; h < block; h *= 2) {
    for (int i = 0; i < n; ++i) {
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
}

// One K or V row as the rotated recipe stores it, before the division by its scale: rotated and
// normalized when `hadamard`, minus `offset` (nullptr: none). The host form of every backend's write.
inline void transform_row(float* row, int head_size, bool hadamard, const float* offset) {
  if (hadamard) {
    const int block = hadamard_block(head_size);
    hadamard_blocks(row, head_size, block);
    const float norm = hadamard_norm(block);
    for (int d = 0; d < head_size; ++d) row[d] = mul_rn(row[d], norm);
  }
  if (offset != nullptr) {
    for (int d = 0; d < head_size; ++d) row[d] -= offset[d];
  }
}

}  // namespace fp8kv
