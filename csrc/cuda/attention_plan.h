// The CUDA backend's AttentionPlan (the launcher contract of csrc/gpu/kernels.h): which kernel runs a
// call and how its work is split, as heuristics.h decides. Plain C++: the bindings hold one.
#pragma once

#include <cstdint>

namespace fp8kv::cuda {

enum class AttentionKernel {
  kDecode,           // decode, and short multi-token queries (decode.cuh)
  kMultiTokenSm80,   // mma.sync, every GPU (multi_token_sm80.cuh)
  kMultiTokenSm90a,  // warp-specialized with warpgroup MMAs, Hopper (multi_token_sm90a.cuh)
  kMultiTokenSm90aFp8Math,  // its FP8-math variant (the call's `fp8_math`)
};

struct AttentionPlan {
  int64_t workspace_bytes;  // the splits' partial results (0 with one split), then decode's work-queue counter
  int request;              // the kernel the caller forced (heuristics.h's MultiTokenRequest), 0: none
  AttentionKernel kernel;
  int num_splits;     // context splits (flash-decoding); 1 writes `out` directly
  int split_tokens;   // context positions per split, a multiple of the kernel's tile group
  bool deep_staging;  // the sm80 multi-token kernel's staging (tiles.h)
  int64_t row_chunks;   // decode: row chunks of all sequences (work items per split and KV head; a bound
                        // for multi-token queries)
  int column_tiles;     // decode: 8-row column tiles per row chunk
  int sequence_table_bytes;  // decode of multi-token queries: the CTAs' table of the sequences (else 0)
  int64_t ctas;         // decode: persistent CTAs taking the work items
  int64_t query_tiles;  // multi-token: grid.x, the query tiles of all sequences (a bound)
};

}  // namespace fp8kv::cuda
