// Host check of the CUDA decode planner (csrc/cuda/heuristics.h), run by scripts/check_cuda_sources.sh;
// not part of the library. Also which kernel takes a multi-token call, the decode kernel's items
// for short ones, and the splits of a call that writes the log-sum-exp. The split counts of the benchmark's decode shapes on an H100 (132 SMs; an H200
// gives the planner the same facts, and its measured best bytes in flight is the same 3 MiB:
// docs/cuda_decode_design.md), worked out by hand below, and over a sweep of shapes: the count is
// never below that of the nearest-items rule; where the bytes-in-flight rule raises it the items stay
// one wave; and a plan with less than kDecodeBytesInFlight in flight could not take one more split.
#include <string>

#include "../cuda/heuristics.h"
#include "expect.h"

namespace fp8kv::cuda {
namespace {

using checks::expect;

constexpr DeviceFacts kH100{132, 9, 0};

PagedAttentionParams decode_call(int seqs, int heads, int kv_heads, int head_size, int capacity, DType cache) {
  PagedAttentionParams p{};
  p.num_seqs = seqs;
  p.num_query_tokens = seqs;  // decode: one query row per sequence
  p.num_heads = heads;
  p.num_kv_heads = kv_heads;
  p.head_size = head_size;
  p.block_size = 16;
  p.max_blocks_per_seq = capacity / 16;
  p.cache_dtype = cache;
  return p;
}

struct Expected {
  const char* shape;
  PagedAttentionParams call;
  int splits, split_tokens;
};

// Items per split (row_items below): sequences x KV heads (every group here fits one row chunk).
// A CTA keeps 4 warps x 16 tokens x (K + V) rows in flight: 16 KiB for FP8 rows of 128, 8 KiB of 64;
// the bytes-in-flight rule asks for 3 MiB.
void check_benchmark_shapes() {
  constexpr DType kE4m3 = DType::kFloat8E4M3FN;
  const Expected table[] = {
      // 8 items: nearest (264 + 4) / 8 = 33 (24 fill 3 MiB); 33 splits of 993 round to 32 of 1024.
      {"Llama-3-8B B1 x 32k", decode_call(1, 32, 8, 128, 32768, kE4m3), 32, 1024},
      // 128 items: nearest 2, 4 MiB.
      {"Llama-3-8B B16 x 4k", decode_call(16, 32, 8, 128, 4096, kE4m3), 2, 2048},
      // 512 items: nearest 1, 8 MiB.
      {"Llama-3-8B B64 x 4k", decode_call(64, 32, 8, 128, 4096, kE4m3), 1, 4096},
      // 64 items (MQA, one group of 8): nearest 4, 4 MiB.
      {"Llama-3-70B TP8 B64 x 4k", decode_call(64, 8, 1, 128, 4096, kE4m3), 4, 1024},
      // 512 items of 8 KiB: 4 MiB with one split.
      {"Llama-3.2-1B B64 x 4k", decode_call(64, 32, 8, 64, 4096, kE4m3), 1, 4096},
      // 512 items of 32 KiB.
      {"Gemma-3-12B B64 x 4k", decode_call(64, 16, 8, 256, 4096, kE4m3), 1, 4096},
      // 2048 items: more than one wave with one split.
      {"Llama-2-7B B64 x 4k", decode_call(64, 32, 32, 128, 4096, kE4m3), 1, 4096},
      // 192 items of 8 KiB: nearest 1 (1.5 MiB); 2 fill 3 MiB, and 384 items are one wave of 528 CTAs.
      {"SmolLM2-135M B64 x 7680", decode_call(64, 9, 3, 64, 7680, kE4m3), 2, 3840},
      // bf16 rows of 64: 16 KiB per CTA, 3 MiB with one split.
      {"SmolLM2-135M B64 x 7680, bf16 cache", decode_call(64, 9, 3, 64, 7680, DType::kBFloat16), 1, 7680},
      // 96 items of 8 KiB: nearest 3 (2.25 MiB); 4 fill 3 MiB, and 384 items are one wave.
      {"SmolLM2-135M B32 x 8k", decode_call(32, 9, 3, 64, 8192, kE4m3), 4, 2048},
  };
  for (const Expected& e : table) {
    const std::optional<Splits> got = decode_splits(e.call, kH100);
    expect(got.has_value() && got->count == e.splits && got->tokens == e.split_tokens,
           std::string(e.shape) + ": " + (got ? std::to_string(got->count) + " splits of " + std::to_string(got->tokens)
                                              : std::string("none")) +
               ", expected " + std::to_string(e.splits) + " of " + std::to_string(e.split_tokens));
  }
}

// The nearest-items rule alone, as it stood before the bytes-in-flight rule: the lower bound.
int nearest_items_splits(const PagedAttentionParams& p, int64_t capacity) {
  const int64_t row_items = std::max<int64_t>(1, decode_row_chunks(p) * p.num_kv_heads);
  const int64_t nearest = (kH100.multiprocessors * kDecodeItemsPerSm + row_items / 2) / row_items;
  const SplitBounds bounds = decode_split_bounds(p);
  return even_splits(capacity, std::clamp(nearest, bounds.least, bounds.most), decode::kTileGroup).count;
}

void check_sweep() {
  const DType caches[] = {DType::kFloat8E4M3FN, DType::kBFloat16};
  const int head_sizes[] = {64, 80, 96, 128, 192, 256};
  const int kv_heads_of[] = {1, 2, 3, 4, 8, 32};
  const int groups[] = {1, 3, 4, 8, 12};
  const int seqs_of[] = {1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512};
  const int capacities[] = {512, 1024, 4096, 7680, 32768, 131072};
  for (DType cache : caches) {
    for (int head_size : head_sizes) {
      for (int kv_heads : kv_heads_of) {
        for (int group : groups) {
          for (int seqs : seqs_of) {
            for (int capacity : capacities) {
              const PagedAttentionParams p = decode_call(seqs, kv_heads * group, kv_heads, head_size, capacity, cache);
              const std::string shape = std::to_string(seqs) + " seqs, " + std::to_string(kv_heads) + "x" +
                                        std::to_string(group) + " heads of " + std::to_string(head_size) + ", " +
                                        std::to_string(capacity) + " tokens";
              const std::optional<Splits> got = decode_splits(p, kH100);
              expect(got.has_value(), shape + ": planned");
              if (!got) continue;
              const int before = nearest_items_splits(p, capacity);
              expect(got->count >= before, shape + ": no fewer splits than the nearest-items rule");
              const int64_t row_items = decode_row_chunks(p) * kv_heads;
              const int64_t one_wave = int64_t{kH100.multiprocessors} * kDecodeCtasPerSm;
              expect(got->count == before || row_items * got->count <= one_wave, shape + ": splits raised beyond one wave");
              // Raised far enough: one more split would leave the wave or the split range, or round
              // back to the same count (even_splits' whole tile groups).
              const int64_t next = got->count + 1;
              expect(row_items * got->count * decode_cta_bytes_in_flight(p) >= kDecodeBytesInFlight ||
                         row_items * next > one_wave || next > decode_split_bounds(p).most ||
                         even_splits(capacity, next, decode::kTileGroup).count == got->count,
                     shape + ": less than kDecodeBytesInFlight in flight where one more split fits");
              expect(static_cast<int64_t>(got->count) * got->tokens >= capacity &&
                         static_cast<int64_t>(got->count - 1) * got->tokens < capacity,
                     shape + ": the splits cover the table, none empty");
              // A call with the log-sum-exp: at least two splits, still whole tile groups within the
              // staged slice, covering the table; a plan of several unchanged.
              const Splits lse = at_least_two(*got, decode::kTileGroup);
              expect(lse.count >= 2 && lse.tokens % decode::kTileGroup == 0 &&
                         lse.tokens <= decode::max_split_tokens(p.block_size) &&
                         static_cast<int64_t>(lse.count) * lse.tokens >= capacity &&
                         (got->count == 1 || (lse.count == got->count && lse.tokens == got->tokens)),
                     shape + ": the log-sum-exp's splits");
            }
          }
        }
      }
    }
  }
}

// Multi-token calls: which kernel the planner picks, and the decode kernel's items for short queries
// (cu_seqlens_q is only tested for null here).
void check_multi_token_routes() {
  static const int32_t kSomeCuSeqlens[1] = {0};
  auto queries = [](int seqs, int64_t tokens, int heads, int kv_heads, int head_size) {
    PagedAttentionParams p = decode_call(seqs, heads, kv_heads, head_size, 4096, DType::kFloat8E4M3FN);
    p.cu_seqlens_q = kSomeCuSeqlens;
    p.num_query_tokens = tokens;
    return p;
  };
  struct Route {
    const char* shape;
    PagedAttentionParams call;
    AttentionKernel kernel;
    int column_tiles;
    int64_t row_chunks, bound;  // decode kernel only
  };
  // Longer queries: the warpgroup-MMA kernel where this build has it.
  const AttentionKernel kLong =
      sm90a_kernel_runs(128, kH100) ? AttentionKernel::kMultiTokenSm90a : AttentionKernel::kMultiTokenSm80;
  const Route routes[] = {
      // 2 draft tokens x 4 heads: one column tile per sequence.
      {"verify B64 x 2", queries(64, 128, 32, 8, 128), AttentionKernel::kDecode, 1, 64, 64 + 64},
      // 4 x 4 = 16 rows: two column tiles, one item per sequence and KV head.
      {"verify B64 x 4", queries(64, 256, 32, 8, 128), AttentionKernel::kDecode, 2, 64, 64 + 64},
      {"verify B64 x 8", queries(64, 512, 32, 8, 128), kLong, 0, 0, 0},
      // Head size 256 (Gemma-3-12B, groups of 2): one tile.
      {"Gemma verify B64 x 4", queries(64, 256, 16, 8, 256), AttentionKernel::kDecode, 1, 64, 64 + 64},
      {"mixed: 64 decodes + 2 x 2k", queries(66, 64 + 4096, 32, 8, 128), kLong, 0, 0, 0},
      {"short rows, 1025 sequences", queries(1025, 1025, 32, 8, 128), AttentionKernel::kMultiTokenSm80, 0, 0, 0},
  };
  for (const Route& r : routes) {
    const AttentionKernel kernel = attention_kernel(r.call, MultiTokenRequest::kAuto, kH100, true);
    expect(kernel == r.kernel, std::string(r.shape) + ": kernel " + std::to_string(static_cast<int>(kernel)));
    if (kernel != AttentionKernel::kDecode) continue;
    expect(decode_column_tiles(r.call) == r.column_tiles, std::string(r.shape) + ": column tiles");
    expect(decode_row_chunks(r.call) == r.row_chunks, std::string(r.shape) + ": row chunks");
    expect(decode_row_chunk_bound(r.call) == r.bound, std::string(r.shape) + ": row chunk bound");
  }
  expect(attention_kernel(routes[1].call, MultiTokenRequest::kSm80, kH100, true) == AttentionKernel::kMultiTokenSm80,
         "a named kernel runs");
  expect(attention_kernel(routes[2].call, MultiTokenRequest::kDecode, kH100, true) == AttentionKernel::kDecode,
         "the decode kernel when named");
  // Short queries whose decode staging does not fit the device: a multi-token kernel (FP8 math's with fp8_math).
  expect(attention_kernel(routes[0].call, MultiTokenRequest::kAuto, kH100, false) == AttentionKernel::kMultiTokenSm80,
         "short queries without room for the decode kernel");
  PagedAttentionParams fp8_math_call = routes[0].call;
  fp8_math_call.fp8_math = true;
  expect(attention_kernel(fp8_math_call, MultiTokenRequest::kAuto, kH100, false) ==
             AttentionKernel::kMultiTokenSm90aFp8Math,
         "short fp8_math queries without room for the decode kernel");
  // fp8_math (plan_unsupported has checked that its kernel runs): the FP8-math kernel wherever
  // a multi-token kernel runs, the decode kernel's calls unchanged (16-bit math, bound by memory).
  for (const Route& r : routes) {
    PagedAttentionParams call = r.call;
    call.fp8_math = true;
    const AttentionKernel kernel = attention_kernel(call, MultiTokenRequest::kAuto, kH100, true);
    expect(kernel == (r.kernel == AttentionKernel::kDecode ? AttentionKernel::kDecode
                                                           : AttentionKernel::kMultiTokenSm90aFp8Math),
           std::string(r.shape) + ", fp8_math: kernel " + std::to_string(static_cast<int>(kernel)));
    expect(attention_kernel(call, MultiTokenRequest::kSm90a, kH100, true) == AttentionKernel::kMultiTokenSm90aFp8Math,
           std::string(r.shape) + ", fp8_math: the sm90a kernel when named");
  }
}

}  // namespace
}  // namespace fp8kv::cuda

int main() {
  fp8kv::cuda::check_benchmark_shapes();
  fp8kv::cuda::check_sweep();
  fp8kv::cuda::check_multi_token_routes();
  return fp8kv::checks::finish("check_cuda_planner");
}
