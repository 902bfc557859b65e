// The rotated recipe's block Hadamard (csrc/hadamard.h) on rows that several lanes of a warp hold:
// the contract's butterflies in its order (h = 1, 2, 4, ...), within a lane's values or, through
// shuffles, across lanes, so a row rotated here has the bits of the host's rotation.
#pragma once

#include "../hadamard.h"

namespace fp8kv::cuda {

// Unnormalized block Hadamard (blocks of kBlock dims) of the rows in v, in place. A lane holds
// kValues values of one row; a dim's bits are [kLow bits: value index bits 0 ..][kLaneBits bits:
// lane bits kLaneShift ..][the rest: value index bits kLow ..]. Lanes that share the value bits and
// differ in the lane bits hold one row; every lane of the warp must call it.
template <int kBlock, int kLow, int kLaneBits, int kLaneShift, int kValues>
__device__ __forceinline__ void hadamard_row(float (&v)[kValues]) {
  static_assert((kBlock & (kBlock - 1)) == 0, "blocks are powers of two");
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int bit = 0; (1 << bit) < kBlock; ++bit) {
    if (bit < kLow || bit >= kLow + kLaneBits) {
      const int stride = bit < kLow ? 1 << bit : 1 << (bit - kLaneBits);
#pragma unroll
      for (int i = 0; i < kValues; ++i) {
        if ((i & stride) == 0) {
          const float a = v[i], b = v[i + stride];
          v[i] = a + b;
          v[i + stride] = a - b;
        }
      }
    } else {
      const int mask = 1 << (kLaneShift + bit - kLow);
      // The lane holding the pair's second element takes other - v, the other v + other: one fma
      // with an exact sign, rounded once as the subtraction and the sum are.
      const float sign = (lane & mask) != 0 ? -1.0f : 1.0f;
#pragma unroll
      for (int i = 0; i < kValues; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, v[i], mask);
        v[i] = fmaf(v[i], sign, other);
      }
    }
  }
}

// log2 of a power of two.
constexpr int log2_exact(int x) { return x <= 1 ? 0 : 1 + log2_exact(x / 2); }

// Calls fn(std::integral_constant<int, block>) for the head size's rotation block (16 .. 256);
// `unsupported` for a head size without one.
inline constexpr int kHadamardBlocks[] = {16, 32, 64, 128, 256};

template <typename Result, typename Fn>
Result dispatch_hadamard_block(int head_size, Result unsupported, Fn&& fn) {
  return dispatch<kHadamardBlocks>(hadamard_block(head_size), unsupported, fn);
}

}  // namespace fp8kv::cuda
