// CPU cache write: quantize each (token, head) row with its scale and scatter it to its slot.
#include <cstring>

#include <ATen/Parallel.h>

#include "../float_conversions.h"
#include "dtype_dispatch.h"
#include "kernels.h"

namespace fp8kv::cpu {
namespace {

template <DType F, DType Src>
void quantize_row(const void* src, uint8_t* dst, float scale, int head_size) {
  const auto* in = static_cast<const typename Element<Src>::Storage*>(src);
  for (int d = 0; d < head_size; ++d) dst[d] = fp8_encode<F>(Element<Src>::to_float(in[d]) / scale);
}

using RowWriter = void (*)(const void* src, uint8_t* dst, float scale, int head_size);

}  // namespace

void reshape_and_cache(const CacheWriteParams& p) {
  // An unquantized cache has the source dtype: rows are copied bit for bit and scales do not apply.
  const bool quantized = is_fp8(p.cache_dtype);
  RowWriter quantize = nullptr;
  if (quantized) {
    dispatch_source_dtype(p.src_dtype, [&](auto src) {
      quantize = dispatch<kFp8DTypes>(p.cache_dtype, quantize, [](auto fp8) {
        return &quantize_row<decltype(fp8)::value, decltype(src)::value>;
      });
    });
  }
  const int64_t src_bytes = dtype_bytes(p.src_dtype);
  const int64_t cache_bytes = dtype_bytes(p.cache_dtype);
  const int64_t row_bytes = p.head_size * cache_bytes;

  auto write = [&](const void* src_base, int64_t token_stride, int64_t head_stride, const CacheView& cache,
                   const HeadScalars& scale, int64_t token, int64_t block, int64_t offset) {
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const auto* src = static_cast<const uint8_t*>(src_base) + (token * token_stride + h * head_stride) * src_bytes;
      auto* dst = static_cast<uint8_t*>(cache.data) +
                  (block * cache.block_stride + offset * cache.token_stride + h * cache.head_stride) * cache_bytes;
      if (quantized) {
        quantize(src, dst, *scale.at(h), p.head_size);
      } else {
        std::memcpy(dst, src, row_bytes);
      }
    }
  };

  at::parallel_for(0, p.num_slots, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / p.block_size;
      const int64_t offset = slot % p.block_size;
      write(p.key, p.key_token_stride, p.key_head_stride, p.key_cache, p.k_scale, t, block, offset);
      write(p.value, p.value_token_stride, p.value_head_stride, p.value_cache, p.v_scale, t, block, offset);
    }
  });
}

}  // namespace fp8kv::cpu
