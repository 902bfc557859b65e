// Tile geometry and the tuning values the CUDA paged-attention kernels (decode, multi-token, merge)
// are compiled with, shared by the kernels and the host planner (heuristics.h). Each chosen value says
// why, briefly; the measurements behind them: docs/cuda_decode_design.md,
// docs/cuda_prefill_design.md.
#pragma once

#include <cstdint>

#include "../dispatch.h"
#include "attention_plan.h"

namespace fp8kv::cuda {

// Per-split partial results in the workspace (plan.workspace_bytes), fp32, when num_splits > 1.
struct SplitWorkspace {
  float* acc;      // [num_splits][rows][head_size], already multiplied by v_scale
  float* row_max;  // [num_splits][rows], log2 domain
  float* row_sum;  // [num_splits][rows]; 0 marks a split without keys for the row
  int64_t rows;    // num_query_tokens * num_heads
  int num_splits;
};

// Lazy rescale: P may grow to 2^kRescaleSlack before the running max is moved (exact: numerator and
// denominator share the max).
inline constexpr float kRescaleSlack = 8.0f;
inline constexpr float kLog2e = 1.4426950408889634f;

namespace merge {
constexpr int kMaxSplits = 256;       // splits one merge CTA handles (one thread per split)
constexpr int kThreads = kMaxSplits;
}  // namespace merge

namespace decode {
// The decode kernel's work items, (row chunk, split, KV head) with the KV head fastest and the row chunk
// (sequence) slowest; a row chunk is up to 8 x column-tiles consecutive rows of one sequence (its query
// tokens x the KV head's query heads, heads fastest). CTA b first takes item b, then, when there are
// more items than CTAs, item gridDim.x + atomicAdd(taken, 1) (`taken` is then zeroed before the
// launch). Sequence-major, so that
// a batch's trailing sequences of length 0 (the padding of a CUDA-graph batch) are the queue's last
// items: a CTA claims its next item when it starts the current one, so empty items interleaved with
// real ones would bind real items to CTAs still busy with their first.
struct WorkQueue {
  int* taken;
  int items;  // multi-token queries: an upper bound (the CTAs count them from cu_seqlens_q)
  int split_tokens;
  int slice_entries;  // block-table entries of one staged slice (two are staged: current and next item)
};

constexpr int kWarps = 4;         // 8 warps only helped batch 1; 4 leaves room for 4 CTAs per SM
// Tiles staged per warp: more fit fewer CTAs per SM and were slower, and slower also where the grid
// has only two CTAs per SM (cuda_decode_design.md, "Staging: whole cache rows").
constexpr int kMaxStages = 2;
// Register cap: four CTAs per SM for head sizes up to 128, whose persistent loop fits 128 registers
// without spills (cuda_decode_design.md, "Registers and CTAs per SM"); larger heads spill under
// that cap, and capping for 5-6 CTAs per SM spilled and was slower. Multi-token queries with one
// column tile keep four (they spill a few registers outside the tile loop; three CTAs, without
// spills, left 512 verification items 1.3 waves and took 15% longer). Two column tiles hold twice
// the query fragments and accumulators: under 170 registers (three CTAs) they spill inside the tile
// loop and took 29% longer than with two CTAs of 222, except at head size 64, which fits 170
// (cuda_prefill_design.md, "Short queries on the decode kernel").
constexpr int min_ctas_per_sm(int head_size, int column_tiles, bool queries) {
  if (head_size > 128) return 1;
  if (!queries || column_tiles == 1) return 4;
  return head_size <= 64 ? 3 : 2;
}
constexpr int kThreads = kWarps * 32;
constexpr int kTileTokens = 16;   // keys per tile: the mma's M
constexpr int kRows = 8;          // query rows of one column tile: the mma's N
// Multi-token queries (verification): an item takes up to this many column tiles of one sequence's
// rows, so that the sequence's pages are streamed once for all its draft tokens (head sizes up to
// 128; larger heads take one tile, their accumulators fill the registers).
constexpr int kMaxColumnTiles = 2;
constexpr int max_column_tiles(int head_size) { return head_size <= 128 ? kMaxColumnTiles : 1; }
// Multi-token queries: each CTA stages a table of the sequences' query starts and first row chunks in
// shared memory (two ints per sequence), so calls of more sequences take the multi-token kernels.
constexpr int kMaxTableSeqs = kCudaDecodeTableSeqs[0];
constexpr int sequence_table_bytes(int num_seqs) { return (2 * (num_seqs + 1) * 4 + 15) / 16 * 16; }
constexpr int kTileGroup = kTileTokens * kWarps;  // split_tokens is a multiple of the warps' tiles
// Block-table entries a CTA stages (caps split_tokens at (kMaxPages - 2) * block_size).
constexpr int kMaxPages = 2048;

// Positions of one split, at most: the block-table slice a CTA stages, in whole tile groups.
inline int64_t max_split_tokens(int block_size) {
  return (static_cast<int64_t>(kMaxPages - 2) * block_size) / kTileGroup * kTileGroup;
}

inline int pages_bytes(const AttentionPlan& plan, int block_size) {
  const int pages = plan.split_tokens / block_size + 2 < kMaxPages ? plan.split_tokens / block_size + 2 : kMaxPages;
  return (pages * 4 + 15) / 16 * 16;
}
}  // namespace decode

namespace multi_token {
constexpr int kWarpRows = 16;    // query rows per warp: the mma's M
constexpr int kSplitAlign = 64;  // split_tokens is a multiple of every head size's key tile

// How a CTA's rows map to (query token, query head): the heads of one KV head's group vary
// fastest, so every K/V tile read from the cache serves all of them. `rows`: query rows per CTA.
struct RowMap {
  int heads_per_tile;   // min(group, rows)
  int head_chunks;      // ceil(group / heads_per_tile)
  int tokens_per_tile;  // rows / heads_per_tile

  __host__ __device__ static RowMap make(int group, int rows) {
    RowMap m;
    m.heads_per_tile = group < rows ? group : rows;
    m.head_chunks = (group + m.heads_per_tile - 1) / m.heads_per_tile;
    m.tokens_per_tile = rows / m.heads_per_tile;
    return m;
  }
};

// The mma.sync kernel (multi_token_sm80.cuh): every warp of a CTA takes 16 of its rows.
namespace sm80 {
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kWarpRows * kWarps;  // query rows per CTA
// Two stagings of the same kernel. Shallow (2 stages, 3 CTAs per SM where registers allow) keeps
// the tensor cores busy when CTAs have many rows (prefill); deep (4 stages, 3 tiles in flight,
// 2 CTAs per SM) keeps enough bytes in flight when they have few (verification, decode rows), as
// the kernel is then bound by memory.
constexpr int kShallowStages = 2;
constexpr int kDeepStages = 4;
constexpr int min_ctas_per_sm(int head_size, int stages) { return head_size <= 128 && stages == kShallowStages ? 3 : 2; }
}  // namespace sm80

// The warp-specialized kernel for sm_90a (multi_token_sm90a.cuh): one producer warpgroup copies and
// converts K/V tiles, two consumer warpgroups of 64 query rows each run warpgroup MMAs on them.
namespace sm90a {
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumers = 2;  // two consumer warpgroups: one's softmax overlaps the other's MMAs
constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
constexpr int kRows = 64 * kConsumers;  // the warpgroup MMA's M per consumer

// Its FP8-math variant (the query and P quantized to e4m3, FP8 warpgroup MMAs with fp32 accumulators).
namespace fp8_math {
inline constexpr float kE4m3Max = 448.0f;  // a query row's largest magnitude is quantized to this
// P is quantized as 2^(logit - max + kProbabilityShift): at most 2^8 = 256 (below e4m3's 448), and
// probabilities down to 2^-14 of the row's max stay normal e4m3 numbers (2^-17 as subnormals).
inline constexpr float kProbabilityShift = 8.0f;
// The shift takes the headroom the lazy rescale would need: a row's max moves as soon as a tile
// exceeds it.
inline constexpr float kRescaleSlack = 0.0f;
// Two-level accumulation: the FP8 MMAs' accumulator keeps about 13 mantissa bits when it adds, so O
// accumulated there over a long row would lose its small terms (and be biased low). P V of
// kPromoteTiles tiles (128 keys, 4 MMA k-steps) is summed there, then added to O in fp32.
inline constexpr int kPromoteTiles = 2;
}  // namespace fp8_math
}  // namespace sm90a
}  // namespace multi_token

}  // namespace fp8kv::cuda
