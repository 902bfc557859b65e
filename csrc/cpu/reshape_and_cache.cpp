// CPU cache write: transform each (token, head) row as its recipe says (docs/rotated_cache.md), quantize
// it with its scale and scatter it to its slot.
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>

#include "../float_conversions.h"
#include "../hadamard.h"
#include "dtype_dispatch.h"
#include "kernels.h"

namespace fp8kv::cpu {
namespace {

template <DType Src>
void load_row(const void* src, float* row, int head_size) {
  const auto* in = static_cast<const typename Element<Src>::Storage*>(src);
  for (int d = 0; d < head_size; ++d) row[d] = Element<Src>::to_float(in[d]);
}

template <DType F>
void encode_row(const float* row, uint8_t* dst, float scale, int head_size) {
  for (int d = 0; d < head_size; ++d) dst[d] = fp8_encode<F>(row[d] / scale);
}

using RowLoader = void (*)(const void* src, float* row, int head_size);
using RowEncoder = void (*)(const float* row, uint8_t* dst, float scale, int head_size);

}  // namespace

void reshape_and_cache(const CacheWriteParams& p) {
  // An unquantized cache has the source dtype: rows are copied bit for bit and scales do not apply.
  const bool quantized = is_fp8(p.cache_dtype);
  RowLoader load = nullptr;
  RowEncoder encode = nullptr;
  if (quantized) {
    dispatch_source_dtype(p.src_dtype, [&](auto src) { load = &load_row<decltype(src)::value>; });
    encode = dispatch<kFp8DTypes>(p.cache_dtype, encode, [](auto fp8) { return &encode_row<decltype(fp8)::value>; });
  }
  const int64_t src_bytes = dtype_bytes(p.src_dtype);
  const int64_t cache_bytes = dtype_bytes(p.cache_dtype);
  const int64_t row_bytes = p.head_size * cache_bytes;

  auto write = [&](const void* src_base, int64_t token_stride, int64_t head_stride, const CacheView& cache,
                   const HeadScalars& scale, const float* offset, int64_t token, int64_t block, int64_t offset_in_block,
                   float* row) {
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const auto* src = static_cast<const uint8_t*>(src_base) + (token * token_stride + h * head_stride) * src_bytes;
      auto* dst = static_cast<uint8_t*>(cache.data) +
                  (block * cache.block_stride + offset_in_block * cache.token_stride + h * cache.head_stride) *
                      cache_bytes;
      if (quantized) {
        load(src, row, p.head_size);
        transform_row(row, p.head_size, p.transform.hadamard,
                      offset != nullptr ? offset + static_cast<int64_t>(h) * p.head_size : nullptr);
        encode(row, dst, *scale.at(h), p.head_size);
      } else {
        std::memcpy(dst, src, row_bytes);
      }
    }
  };

  at::parallel_for(0, p.num_slots, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(p.head_size);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / p.block_size;
      const int64_t offset_in_block = slot % p.block_size;
      write(p.key, p.key_token_stride, p.key_head_stride, p.key_cache, p.k_scale, p.transform.k_offset, t, block,
            offset_in_block, row.data());
      write(p.value, p.value_token_stride, p.value_head_stride, p.value_cache, p.v_scale, nullptr, t, block,
            offset_in_block, row.data());
    }
  });
}

}  // namespace fp8kv::cpu
