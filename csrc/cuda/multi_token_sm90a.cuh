// CUDA paged attention for multi-token queries on Hopper (sm_90a): warp-specialized, with warpgroup
// MMAs. A producer warpgroup stages each K/V tile with cp.async and hands it over through named
// barriers; two consumer warpgroups of 64 query rows each compute S = Q K^T and O += P V as warpgroup
// MMAs with P in registers, and the softmax step of multi_token.cuh between them, pipelined one tile
// deep and taking turns (ping-pong) so that softmax overlaps MMAs, while the producer's work on the
// next tiles overlaps both. Two maths:
// - 16-bit (SixteenBitMath): FP8 tiles land in a raw ring and the producer converts them into 16-bit
//   operands; 16-bit tiles land straight in the swizzled layout the tensor cores read; Q in registers
//   up to head size 128, above in shared memory.
// - FP8 (Fp8Math, FP8 caches, head sizes 64 and 128): the query is quantized to e4m3 per row, K lands
//   straight in its swizzled layout, the producer transposes V (K-major, as FP8 MMAs need), P is
//   quantized to e4m3, and O accumulates in two levels (fp8_math::kPromoteTiles).
// Design: docs/cuda_prefill_design.md.
#pragma once

#include <type_traits>

#include "multi_token.cuh"
#include "wgmma.cuh"

namespace fp8kv::cuda::multi_token::sm90a {

// Named barriers (16 per CTA, 0 is __syncthreads): full_barrier(c, s), the producer has filled stage s
// for consumer c (one per consumer, so that the consumers need not meet at every tile); kEmptyBarrier
// + s, both consumers are done with stage s; the producer warpgroup's own; kTurnBarrier + c, consumer
// c may issue its MMAs (ping-pong, see consume).
constexpr int kMaxStages = 4;
constexpr int kEmptyBarrier = 1 + kConsumers * kMaxStages;
constexpr int kProducerBarrier = kEmptyBarrier + kMaxStages;
constexpr int kTurnBarrier = kProducerBarrier + 1;
static_assert(kTurnBarrier + kConsumers <= 16, "named barriers");
__device__ __forceinline__ int full_barrier(int consumer, int stage) { return 1 + consumer * kMaxStages + stage; }
constexpr int kPairThreads = 2 * kWarpgroupThreads;  // a full or turn barrier's two warpgroups

static_assert(kConsumers == 2, "the turn protocol of consume is written for two consumers");

// Tiles and shared-memory geometry of the 16-bit math (kFp8Math false). An operand (the K or the V of
// one tile) is D / 64 regions of kKeys swizzled rows, dims 64h .. 64h + 63 in region h; a stage holds
// K, then V. Above head size 128, O's D / 2 registers leave no room for Q's D / 4: each consumer's Q
// is staged in shared memory once (the same swizzled regions, of its 64 rows), and tiles have 32 keys
// so that it fits there beside the stages.
template <DType C, int D, bool kFp8Math = false>
struct Stages {
  static constexpr bool kFp8 = CacheTraits<C>::kIsFp8;
  static constexpr int kKeys = D <= 128 ? 64 : 32;  // S is 64 x kKeys per consumer
  static_assert(kSplitAlign % kKeys == 0, "splits must start on a tile");
  static constexpr bool kQueryInSmem = D > 128;
  static constexpr int kRegionBytes = kKeys * wgmma::kSwizzleRowBytes;
  static constexpr int kOperandBytes = D / wgmma::kSwizzleRowElements * kRegionBytes;
  static constexpr int kStageBytes = 2 * kOperandBytes;
  // FP8: three operand stages (the consumers hold two: one tile's P V and the next one's S are in
  // flight together; the producer converts into the third) and a raw ring of three (two tiles in
  // flight while one is converted). 16-bit: four operand stages, two held and two in flight.
  static constexpr int kStages = kFp8 ? 3 : 4;
  static_assert(kFp8 || kStages >= 3, "16-bit tiles: at least one in flight besides the two held");
  static_assert(kStages <= kMaxStages, "a full and an empty barrier per stage");
  static constexpr int kRawStages = kFp8 ? 3 : 0;
  static constexpr int kRawBytes = 2 * kKeys * D;  // row-major FP8 K rows, then V rows
  static constexpr int kQueryOffset = kStages * kStageBytes + kRawStages * kRawBytes;
  static constexpr int kQueryBytes = kQueryInSmem ? kRows * D * 2 : 0;  // consumer c's at c * kQueryBytes / 2
  // + the alignment of the swizzled regions (the dynamic block follows the static one).
  static constexpr int kSmemBytes = kQueryOffset + kQueryBytes + wgmma::kSwizzleAtomBytes;
};

// The FP8 math's: a stage holds K as it is in the cache (kKeys rows of D e4m3/e5m2 bytes, K-major for
// S = Q K^T, swizzled in rows of D bytes), then V transposed (D rows of kKeys bytes, K-major for
// O += P V). K lands there by cp.async; V lands in a raw ring (row-major, as in the cache) and the
// producer transposes it into the stage. kAhead tiles are in flight while the consumers hold two.
template <DType C, int D>
struct Stages<C, D, true> {
  static_assert(CacheTraits<C>::kIsFp8 && D <= 128, "FP8 math: FP8 caches, head sizes up to 128");
  static constexpr int kKeys = 64;
  static_assert(kSplitAlign % kKeys == 0, "splits must start on a tile");
  static constexpr int kKeyRowBytes = D;        // a key's D values
  static constexpr int kValueRowBytes = kKeys;  // one dim of every key
  static constexpr int kKeyBytes = kKeys * D;
  static constexpr int kStageBytes = 2 * kKeys * D;
  static constexpr int kStages = kMaxStages;
  static constexpr int kAhead = kStages - 2;  // a stage refilled is one the consumers released
  static constexpr int kRawStages = kAhead + 1;  // tiles in flight and the one being transposed
  static constexpr int kRawBytes = kKeys * D;  // V rows only
  static constexpr int kQueryOffset = kStages * kStageBytes + kRawStages * kRawBytes;
  static constexpr int kQueryBytes = 0;  // Q stays in registers
  static constexpr int kSmemBytes = kQueryOffset + wgmma::kSwizzleAtomBytes;
};

// Byte offset of 16-byte chunk `chunk` (dims 8 chunk ..) of row `row` in a swizzled operand of kRowsOf
// rows (D / 64 regions of them).
template <int kRowsOf>
__device__ __forceinline__ uint32_t swizzled_operand_offset(int row, int chunk) {
  return chunk / 8 * (kRowsOf * wgmma::kSwizzleRowBytes) + wgmma::swizzled_offset(row, chunk % 8);
}

// A producer thread's share of one raw FP8 tile: 8-value runs at a fixed chunk of the rows it strides
// over (K rows, then V rows), loaded into registers, then converted into the 16-bit operands of a
// stage. Every load of a part is issued before its first store (the compiler cannot tell the raw ring
// from the stages and would wait out each load's latency in turn). Above head size 128 the producer has
// fewer registers (RegisterSplit): the tile goes in two parts, K's rows, then V's.
template <DType C, int D>
struct RawTileShare {
  static constexpr int kKeys = Stages<C, D>::kKeys;
  static constexpr int kParts = D <= 128 ? 1 : 2;
  static constexpr int kChunks = D / 8;
  static constexpr int kRowsPerPass = kWarpgroupThreads / kChunks;
  static constexpr int kPasses = 2 * kKeys / kRowsPerPass / kParts;  // of one part
  uint2 bytes[kPasses];

  __device__ __forceinline__ int chunk() const { return threadIdx.x % kChunks; }
  __device__ __forceinline__ int row(int part, int pass) const {
    return threadIdx.x / kChunks + (part * kPasses + pass) * kRowsPerPass;
  }

  __device__ __forceinline__ void load(const uint8_t* raw, int part) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) bytes[i] = *reinterpret_cast<const uint2*>(raw + row(part, i) * D + chunk() * 8);
  }
  __device__ __forceinline__ void convert_into(uint8_t* stage, int part) const {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = this->row(part, i);
      uint4 half;
      convert_fp8x4<C>(bytes[i].x, half.x, half.y);
      convert_fp8x4<C>(bytes[i].y, half.z, half.w);
      *reinterpret_cast<uint4*>(stage + row / kKeys * Stages<C, D>::kOperandBytes +
                                swizzled_operand_offset<kKeys>(row % kKeys, chunk())) = half;
    }
  }
};

// The FP8 math's key order: O += P V takes P's keys in the order the S accumulators hold them, so that
// P needs no shuffles. Within each 16 keys, position 4t + e (P fragment byte e of lane t) is key
// 2t + e % 2 + 8 (e / 2). The producer stores V's keys in that order: its raw tile (kKeys rows of D
// FP8 bytes) transposed into D rows of kKeys bytes (swizzled), row d holding dim d. A producer thread
// moves a block of 16 keys x 4 dims: 16 words loaded, byte-permuted into four 16-byte rows.
template <int D, int kKeys>
__device__ __forceinline__ void transpose_values(const uint8_t* raw, uint8_t* operand) {
  constexpr int kDimGroups = D / 4;
  constexpr int kBlocks = kDimGroups * (kKeys / 16);
#pragma unroll
  for (int block = threadIdx.x % kWarpgroupThreads; block < kBlocks; block += kWarpgroupThreads) {
    const int dim = block % kDimGroups * 4, key = block / kDimGroups * 16;
    uint32_t word[16];  // word[k]: dims dim .. dim + 3 of key `key` + k
#pragma unroll
    for (int k = 0; k < 16; ++k) word[k] = *reinterpret_cast<const uint32_t*>(raw + (key + k) * D + dim);
    uint32_t row[4][4];  // row[q]: dim + q's 16 keys, four to a word, in the key order
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      // Word m of a row holds keys 2m, 2m + 1, 2m + 8, 2m + 9 (positions 4m .. 4m + 3).
      const uint32_t low = __byte_perm(word[2 * m], word[2 * m + 1], 0x5140);  // dims 0, 1 of keys 2m, 2m + 1
      const uint32_t high = __byte_perm(word[2 * m], word[2 * m + 1], 0x7362);  // dims 2, 3
      const uint32_t low8 = __byte_perm(word[2 * m + 8], word[2 * m + 9], 0x5140);
      const uint32_t high8 = __byte_perm(word[2 * m + 8], word[2 * m + 9], 0x7362);
      row[0][m] = __byte_perm(low, low8, 0x5410);
      row[1][m] = __byte_perm(low, low8, 0x7632);
      row[2][m] = __byte_perm(high, high8, 0x5410);
      row[3][m] = __byte_perm(high, high8, 0x7632);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      *reinterpret_cast<uint4*>(operand + wgmma::swizzled_offset<kKeys>(dim + q, key / 16)) =
          make_uint4(row[q][0], row[q][1], row[q][2], row[q][3]);
    }
  }
}

// The producer warpgroup: stages tiles first_tile, first_tile + kKeys, ... (num_tiles of them) and
// publishes each on both consumers' full barriers of its stage once its operands are in shared memory.
template <DType C, int D, bool kFp8Math>
__device__ __forceinline__ void produce(const PagedAttentionParams& p, const CtaWork& w, int first_tile,
                                       int num_tiles, uint8_t* smem) {
  using S = Stages<C, D, kFp8Math>;
  constexpr int kKeys = S::kKeys;
  const int32_t* table_row = p.block_tables + w.seq * p.block_table_stride;
  uint8_t* raw = smem + S::kStages * S::kStageBytes;
  // A stage is refilled once the consumers are done with the tile kStages before.
  auto wait_empty = [&](int tile) {
    if (tile >= S::kStages) wgmma::barrier_sync(kEmptyBarrier + tile % S::kStages, kThreads);
  };
  // The tensor cores read what this thread wrote (stores or cp.async): fence, then hand over.
  auto publish = [&](int tile) {
    wgmma::fence_async_proxy();
#pragma unroll
    for (int c = 0; c < kConsumers; ++c) {
      wgmma::barrier_arrive(full_barrier(c, tile % S::kStages), kPairThreads);
    }
  };
  if constexpr (kFp8Math) {
    // K into its stage, V into the raw ring, by warpgroup 0 (threads 0 .. kWarpgroupThreads - 1).
    auto stage = [&](int tile) {
      uint8_t* keys = smem + tile % S::kStages * S::kStageBytes;
      uint8_t* values = raw + tile % S::kRawStages * S::kRawBytes;
      copy_tile_rows<C, D, kKeys, kWarpgroupThreads>(
          p, w, table_row, first_tile + tile * kKeys, keys,
          [](int key, int chunk) { return static_cast<int>(wgmma::swizzled_offset<S::kKeyRowBytes>(key, chunk)); },
          [&](uint8_t* /*key_dst*/, int key, int chunk) { return values + key * D + chunk * 16; });
    };
    for (int k = 0; k < S::kAhead; ++k) {
      if (k < num_tiles) stage(k);
      copy_async_commit();
    }
    for (int k = 0; k < num_tiles; ++k) {
      copy_async_wait<S::kAhead - 1>();
      // Tile k's bytes are visible to the warpgroup, and tile k - 1's raw V is transposed.
      wgmma::barrier_sync(kProducerBarrier, kWarpgroupThreads);
      transpose_values<D, kKeys>(raw + k % S::kRawStages * S::kRawBytes,
                                 smem + k % S::kStages * S::kStageBytes + S::kKeyBytes);
      publish(k);
      const int ahead = k + S::kAhead;
      if (ahead < num_tiles) {
        wait_empty(ahead);
        stage(ahead);
      }
      copy_async_commit();
    }
  } else {
    // Warpgroup 0: threads 0 .. kWarpgroupThreads - 1 stage the tiles.
    auto stage = [&](int tile, uint8_t* dst) {
      stage_tile<C, D, kKeys, kWarpgroupThreads>(
          p, w, table_row, first_tile + tile * kKeys, dst,
          [](int key, int chunk) { return static_cast<int>(swizzled_operand_offset<kKeys>(key, chunk)); },
          S::kOperandBytes);
    };
    if constexpr (S::kFp8) {
      for (int k = 0; k < S::kRawStages - 1; ++k) {
        if (k < num_tiles) stage(k, raw + k * S::kRawBytes);
        copy_async_commit();
      }
      for (int k = 0; k < num_tiles; ++k) {
        copy_async_wait<S::kRawStages - 2>();
        // Tile k's raw bytes are visible to the warpgroup, and tile k - 1's raw stage is converted.
        wgmma::barrier_sync(kProducerBarrier, kWarpgroupThreads);
        const int ahead = k + S::kRawStages - 1;
        if (ahead < num_tiles) stage(ahead, raw + ahead % S::kRawStages * S::kRawBytes);
        copy_async_commit();
        wait_empty(k);
        using Share = RawTileShare<C, D>;
#pragma unroll
        for (int part = 0; part < Share::kParts; ++part) {
          Share share;
          share.load(raw + k % S::kRawStages * S::kRawBytes, part);
          share.convert_into(smem + k % S::kStages * S::kStageBytes, part);
        }
        publish(k);
      }
    } else {
      // kStages - 2 tiles in flight: the stage refilled after publishing tile k is tile k - 2's, which
      // the consumers release while working on tile k - 1 (refilling tile k - 1's stage would hold the
      // publishing of tile k + 1 until both consumers are done with tile k - 1).
      constexpr int kAhead = S::kStages - 2;
      for (int k = 0; k < kAhead; ++k) {
        if (k < num_tiles) stage(k, smem + k * S::kStageBytes);
        copy_async_commit();
      }
      for (int k = 0; k < num_tiles; ++k) {
        copy_async_wait<kAhead - 1>();
        publish(k);
        const int ahead = k + kAhead;
        if (ahead < num_tiles) {
          wait_empty(ahead);
          stage(ahead, smem + ahead % S::kStages * S::kStageBytes);
        }
        copy_async_commit();
      }
    }
  }
  copy_async_wait<0>();
}

// Positions a consumer warpgroup's rows see: any row [lo, hi), every row [interior_lo, interior_hi).
struct WarpgroupRange {
  int lo, hi, interior_lo, interior_hi;
};

// Q, the A operand of a consumer's S = Q K^T in 16-bit math (its 64 rows): the lane's fragments in
// registers, or, where Stages::kQueryInSmem, staged once into the consumer's swizzled region of shared
// memory.
template <DType C, int D, bool kInSmem = Stages<C, D>::kQueryInSmem>
struct QueryOperand {
  uint32_t frag[D / 16][4];

  __device__ __forceinline__ void load(const PagedAttentionParams& p, LaneQueryRows& rows, int kv_head, int t,
                                       bool query_bf16, uint8_t* /*region*/) {
    load_query<C, D>(p, rows, kv_head, t, query_bf16, frag);
  }
  // Issues k-step `step` (dims 16 step ..) of S = Q K^T against the K operand at key_desc.
  template <bool kBf16>
  __device__ __forceinline__ void issue_scores(float (&s)[8][4], int step, uint64_t key_desc) const {
    wgmma::mma<kBf16, 0>(s, frag[step], key_desc, step > 0);
  }
};

template <DType C, int D>
struct QueryOperand<C, D, true> {
  static constexpr int kRegionBytes = 64 * wgmma::kSwizzleRowBytes;  // 64 rows of 64 dims
  uint32_t region;  // shared address

  // Every lane of the warpgroup stores its fragments (rows 16 warp + g, + 8 of the region) and makes
  // them visible to the tensor cores; the first full barrier the consumer passes orders them before
  // any of its MMAs.
  __device__ __forceinline__ void load(const PagedAttentionParams& p, LaneQueryRows& rows, int kv_head, int t,
                                       bool query_bf16, uint8_t* dst) {
    uint32_t frag[D / 16][4];
    load_query<C, D>(p, rows, kv_head, t, query_bf16, frag);
    const int row = threadIdx.x % kWarpgroupThreads / 32 * 16 + threadIdx.x % 32 / 4;
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // i = 2 half + r: row + 8 r, dims 16 step + 8 half + 2t
        *reinterpret_cast<uint32_t*>(dst + swizzled_operand_offset<64>(row + 8 * (i % 2), 2 * step + i / 2) + 4 * t) =
            frag[step][i];
      }
    }
    wgmma::fence_async_proxy();
    region = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  }
  template <bool kBf16>
  __device__ __forceinline__ void issue_scores(float (&s)[4][4], int step, uint64_t key_desc) const {
    const uint32_t at = region + step / 4 * kRegionBytes + step % 4 * 32;  // as K's, see issue_scores below
    wgmma::mma_smem_a<kBf16>(s, wgmma::descriptor(at, 16, wgmma::kSwizzleAtomBytes), key_desc, step > 0);
  }
};

// What a consumer computes per tile, in one of the two maths; consume runs it. Each provides:
// load(...)                       its query operand (before the first tile)
// issue_scores(stage, s)          S = Q K^T's MMAs for the tile in stage `stage` (shared address)
// issue_values(stage, p, tile, st)  O += P V's MMAs
// softmax(s, st, rows, start, interior, soft_cap, p, rescale)  the tile's softmax step into P
// pin_accumulator(st)             keeps the compiler off the registers P V's MMAs write
// values_done(st, tile, rescale)  after tile's P V is done and the next tile's softmax moved the maxima
// first_softmax_done(st, rescale), last_values_done(st)  the same at either end.

// 16-bit math: FP8 tiles converted to fp16 by the producer; O accumulates in the MMAs' fp32.
template <DType C, int D>
struct SixteenBitMath {
  using S = Stages<C, D>;
  static constexpr int kKeys = S::kKeys;
  static constexpr bool kBf16 = CacheTraits<C>::kBf16Math;
  using Probabilities = uint32_t[kKeys / 16][4];
  QueryOperand<C, D> q;
  float multiplier;

  __device__ __forceinline__ void load(const PagedAttentionParams& p, LaneQueryRows& rows, int kv_head, int t,
                                       bool query_bf16, uint8_t* region) {
    q.load(p, rows, kv_head, t, query_bf16, region);
    multiplier = logit_multiplier<C>(p, kv_head);
  }
  __device__ __forceinline__ void issue_scores(uint32_t stage, float (&s)[kKeys / 8][4]) const {
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
      // K is K-major (dims contiguous): a step's 16 dims are 32 bytes into the swizzled rows of
      // region step / 4; 8-key groups are one swizzle period apart.
      const uint32_t at = stage + step / 4 * S::kRegionBytes + step % 4 * 32;
      q.template issue_scores<kBf16>(s, step, wgmma::descriptor(at, 16, wgmma::kSwizzleAtomBytes));
    }
  }
  __device__ __forceinline__ void issue_values(uint32_t stage, const Probabilities& p, int /*tile*/,
                                               WarpState<D>& st) const {
    constexpr int kOutputMmas = (D + 127) / 128;  // an MMA's N is at most 128
    constexpr int kOutputTiles = D / 8 / kOutputMmas;  // O's n-tiles per MMA
    const uint32_t value_smem = stage + S::kOperandBytes;
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      // V is N-major (dims contiguous): keys 16kk .. are two 8-row groups one swizzle period apart,
      // dims 64h .. in region h. At most 128 dims per MMA: dims 128 o .. in O's n-tiles 16 o ...
#pragma unroll
      for (int o = 0; o < kOutputMmas; ++o) {
        const uint32_t at = value_smem + 2 * o * S::kRegionBytes + kk * 16 * wgmma::kSwizzleRowBytes;
        wgmma::mma<kBf16, 1>(reinterpret_cast<float(&)[kOutputTiles][4]>(st.acc[kOutputTiles * o]), p[kk],
                             wgmma::descriptor(at, S::kRegionBytes, wgmma::kSwizzleAtomBytes), true);
      }
    }
  }
  __device__ __forceinline__ void softmax(float (&s)[kKeys / 8][4], WarpState<D>& st, const LaneQueryRows& rows,
                                          int start, bool interior, float soft_cap, Probabilities& p,
                                          float (&rescale)[2]) const {
    softmax_step<kBf16, D>(s, st, rows, start, interior, multiplier, soft_cap, p, rescale);
  }
  __device__ __forceinline__ void pin_accumulator(WarpState<D>& st) const { wgmma::pin(st.acc); }
  __device__ __forceinline__ void values_done(WarpState<D>& st, int /*tile*/, const float (&rescale)[2]) const {
    rescale_output(st, rescale);
  }
  __device__ __forceinline__ void first_softmax_done(WarpState<D>& st, const float (&rescale)[2]) const {
    rescale_output(st, rescale);
  }
  __device__ __forceinline__ void last_values_done(WarpState<D>& /*st*/) const {}
};

// FP8 math: Q quantized to e4m3 per row (its largest magnitude to fp8_math::kE4m3Max; the row's scale
// goes into its logit multiplier), S = Q K^T and O += P V as FP8 MMAs (A e4m3 from registers, B the
// cache's format from shared memory), P quantized to e4m3 in the key order above, and P V summed over
// fp8_math::kPromoteTiles tiles in `partial` before it is added to O in fp32.
template <DType C, int D>
struct Fp8Math {
  using S = Stages<C, D, true>;
  static constexpr int kKeys = S::kKeys;
  static constexpr bool kValuesE5m2 = C == DType::kFloat8E5M2;
  static_assert(C == DType::kFloat8E4M3FN || kValuesE5m2, "FP8 math reads e4m3fn and e5m2 caches");
  using Probabilities = uint32_t[kKeys / 32][4];
  uint32_t q[D / 32][4];  // k-step `step`: rows g, g + 8, dims 32 step + 16 half + 4t .. + 3
  float multiplier[2];    // per row: logit_multiplier times the row's quantization scale
  float partial[D / 8][4];

  // Lane t's dims of its rows: 16 c + 4t + e (value 4c + e): the lowest two bits in the lane's
  // values, the next two its lane bits, the rest its values again.
  __device__ __forceinline__ void load(const PagedAttentionParams& p, LaneQueryRows& rows, int kv_head, int t,
                                       bool query_bf16, uint8_t* /*region*/) {
    const float base = logit_multiplier<C>(p, kv_head);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) partial[n][0] = partial[n][1] = partial[n][2] = partial[n][3] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const QueryRow<false> row(p, rows.query_row[r], rows.head[r], query_bf16);
      float x[D / 4];
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const float2 low = pair_as_float2(row.bits(16 * c + 4 * t), row.bf16);
        const float2 high = pair_as_float2(row.bits(16 * c + 4 * t + 2), row.bf16);
        x[4 * c] = row.valid ? low.x : 0.f, x[4 * c + 1] = row.valid ? low.y : 0.f;
        x[4 * c + 2] = row.valid ? high.x : 0.f, x[4 * c + 3] = row.valid ? high.y : 0.f;
      }
      rows.logit_offset[r] = -0.f;
      if (p.transform.hadamard) {
        constexpr int kBlock = hadamard_block(D);
        hadamard_row<kBlock, 2, 2, 0>(x);
#pragma unroll
        for (int i = 0; i < D / 4; ++i) x[i] = mul_rn(x[i], hadamard_norm(kBlock));
        rows.logit_offset[r] =
            logit_offset(p, kv_head, x, [&](int v) { return v % 4 + 4 * t + 16 * (v / 4); }, {1, 2});
      }
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < D / 4; ++i) amax = fmaxf(amax, fabsf(x[i]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const float to_fp8 = amax > 0.f ? fp8_math::kE4m3Max / amax : 1.f;
      multiplier[r] = amax > 0.f ? base * (amax / fp8_math::kE4m3Max) : base;
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        q[c / 2][2 * (c % 2) + r] = pack_e4m3x4(x[4 * c] * to_fp8, x[4 * c + 1] * to_fp8, x[4 * c + 2] * to_fp8,
                                                x[4 * c + 3] * to_fp8);
      }
    }
  }
  __device__ __forceinline__ void issue_scores(uint32_t stage, float (&s)[kKeys / 8][4]) const {
#pragma unroll
    for (int step = 0; step < D / 32; ++step) {
      // K is K-major: a step's 32 dims are 32 bytes into the key rows; 8-key groups are 8 rows apart.
      wgmma::mma_fp8<kValuesE5m2>(
          s, q[step], wgmma::descriptor<S::kKeyRowBytes>(stage + 32 * step, 16, 8 * S::kKeyRowBytes), step > 0);
    }
  }
  __device__ __forceinline__ void issue_values(uint32_t stage, const Probabilities& p, int tile,
                                               WarpState<D>& /*st*/) {
    const bool accumulate = tile % fp8_math::kPromoteTiles != 0;  // else partial starts afresh
#pragma unroll
    for (int kk = 0; kk < kKeys / 32; ++kk) {
      // V is transposed (keys contiguous): a step's 32 keys are 32 bytes into the dim rows.
      const uint32_t at = stage + S::kKeyBytes + 32 * kk;
      wgmma::mma_fp8<kValuesE5m2>(partial, p[kk],
                                  wgmma::descriptor<S::kValueRowBytes>(at, 16, 8 * S::kValueRowBytes),
                                  kk > 0 || accumulate);
    }
  }
  __device__ __forceinline__ void softmax(float (&s)[kKeys / 8][4], WarpState<D>& st, const LaneQueryRows& rows,
                                          int start, bool interior, float soft_cap, Probabilities& p,
                                          float (&rescale)[2]) const {
    scale_and_mask(s, rows, start, interior, [&](int r) { return multiplier[r]; }, soft_cap);
    exponentiate(s, st, fp8_math::kRescaleSlack, fp8_math::kProbabilityShift, rescale);
    // P's fragment for keys 32kk ..: register i = 2 half + r holds row g + 8r, the keys of S's n-tiles
    // 4kk + 2 half and 4kk + 2 half + 1 that lane t holds (the key order above).
#pragma unroll
    for (int kk = 0; kk < kKeys / 32; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * kk + 2 * (i / 2), r = i % 2;
        p[kk][i] = pack_e4m3x4(s[j][2 * r], s[j][2 * r + 1], s[j + 1][2 * r], s[j + 1][2 * r + 1]);
      }
    }
  }
  __device__ __forceinline__ void pin_accumulator(WarpState<D>& /*st*/) { wgmma::pin(partial); }
  // O += partial at the end of each kPromoteTiles tiles; rows whose max moved scale both.
  __device__ __forceinline__ void values_done(WarpState<D>& st, int tile, const float (&rescale)[2]) {
    if (tile % fp8_math::kPromoteTiles == fp8_math::kPromoteTiles - 1) last_values_done(st);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (rescale[h] != 1.f) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          st.acc[n][2 * h] *= rescale[h], st.acc[n][2 * h + 1] *= rescale[h];
          partial[n][2 * h] *= rescale[h], partial[n][2 * h + 1] *= rescale[h];
        }
      }
    }
  }
  __device__ __forceinline__ void first_softmax_done(WarpState<D>& /*st*/, const float (&/*rescale*/)[2]) const {}
  __device__ __forceinline__ void last_values_done(WarpState<D>& st) const {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) st.acc[n][i] += partial[n][i];
    }
  }
};

template <DType C, int D, bool kFp8Math>
using ConsumerMath = std::conditional_t<kFp8Math, Fp8Math<C, D>, SixteenBitMath<C, D>>;

// Consumer `consumer`: it attends to every tile the producer publishes, into st (the tiles its rows do
// not see are masked). Pipelined one tile deep: tile k's S = Q K^T and tile k - 1's O += P V are
// issued together, and tile k's softmax runs while the latter is in flight; a stage is released (when
// the producer will refill it) once its P V is done. Ping-pong (as FlashAttention-3): the consumers
// take turns issuing their MMAs, so that one's softmax runs while the tensor cores work through the
// other's MMAs rather than both at once.
template <int D, typename Math>
__device__ __forceinline__ void consume(int consumer, const LaneQueryRows& rows, const WarpgroupRange& range,
                                       Math& math, float soft_cap, int first_tile, int num_tiles, uint32_t smem,
                                       WarpState<D>& st) {
  using S = typename Math::S;
  constexpr int kKeys = S::kKeys;

  auto acquire = [&](int k) { wgmma::barrier_sync(full_barrier(consumer, k % S::kStages), kPairThreads); };
  // Turns alternate consumer 0, 1, 0, 1, ...: each waits for its turn before issuing MMAs and passes it
  // on after (consumer 1 gives consumer 0 its first turn and does not pass its last). Both take
  // num_tiles + 1 turns (the first tile's S, one per further tile, the last tile's P V).
  auto take_turn = [&]() { wgmma::barrier_sync(kTurnBarrier + consumer, kPairThreads); };
  auto pass_turn = [&](bool last) {
    const int next = (consumer + 1) % kConsumers;
    if (!(last && next == 0)) wgmma::barrier_arrive(kTurnBarrier + next, kPairThreads);
  };
  auto release = [&](int k) {
    if (k + S::kStages < num_tiles) wgmma::barrier_arrive(kEmptyBarrier + k % S::kStages, kThreads);
  };
  auto stage = [&](int k) { return smem + k % S::kStages * S::kStageBytes; };
  auto issue_scores = [&](int k, float (&s)[kKeys / 8][4]) {
    math.issue_scores(stage(k), s);
    wgmma::commit();
  };
  using Probabilities = typename Math::Probabilities;
  auto issue_values = [&](int k, const Probabilities& p) {
    math.issue_values(stage(k), p, k, st);
    wgmma::commit();
  };
  auto softmax = [&](int k, float (&s)[kKeys / 8][4], Probabilities& p, float (&rescale)[2]) {
    const int start = first_tile + k * kKeys;
    const bool interior = start >= range.interior_lo && start + kKeys <= range.interior_hi;
    math.softmax(s, st, rows, start, interior, soft_cap, p, rescale);
  };

  // Tile k - 1's P is read by its P V while tile k's softmax writes the other buffer: two P buffers,
  // swapped by unrolling (a copy from one to the other would be a register write the in-flight MMA
  // depends on, and the compiler would serialize the MMAs around it).
  float s[kKeys / 8][4];
  float rescale[2];
  auto iteration = [&](int k, Probabilities& p, Probabilities& p_next) {
    acquire(k);
    wgmma::pin(p);  // every register the MMAs read is final before they start
    math.pin_accumulator(st);
    take_turn();
    wgmma::fence();
    issue_scores(k, s);
    issue_values(k - 1, p);
    pass_turn(false);
    wgmma::wait<1>();  // S of tile k (committed first)
    wgmma::pin(s);
    softmax(k, s, p_next, rescale);
    wgmma::wait<0>();  // O += P V of tile k - 1
    math.pin_accumulator(st);
    wgmma::pin(p);
    release(k - 1);
    math.values_done(st, k - 1, rescale);
  };
  auto finish = [&](Probabilities& p) {
    wgmma::pin(p);
    math.pin_accumulator(st);
    take_turn();
    wgmma::fence();
    issue_values(num_tiles - 1, p);
    pass_turn(true);
    wgmma::wait<0>();
    math.pin_accumulator(st);
    wgmma::pin(p);
    release(num_tiles - 1);
    math.last_values_done(st);
  };

  if (num_tiles > 0 && consumer == 1) wgmma::barrier_arrive(kTurnBarrier, kPairThreads);
  if (!(range.lo < range.hi)) {
    // Only padding rows: the same turns and releases, without MMAs.
    for (int k = 0; k < num_tiles; ++k) {
      acquire(k);
      take_turn();
      pass_turn(false);
      release(k);
    }
    if (num_tiles > 0) take_turn(), pass_turn(true);
    return;
  }
  if (num_tiles > 0) {
    Probabilities p0, p1;
    acquire(0);
    take_turn();
    wgmma::fence();
    issue_scores(0, s);
    pass_turn(false);
    wgmma::wait<0>();
    wgmma::pin(s);
    softmax(0, s, p0, rescale);
    math.first_softmax_done(st, rescale);
    for (int k = 1; k < num_tiles; k += 2) {
      iteration(k, p0, p1);
      if (k + 1 < num_tiles) iteration(k + 1, p1, p0);
    }
    if ((num_tiles - 1) % 2 == 0) {
      finish(p0);
    } else {
      finish(p1);
    }
  }
}

// A consumer warpgroup's work once cta_work has run: its rows' range from its warps' (warp_ranges), its
// query operand, the tiles, and the epilogue.
template <DType C, int D, bool kFp8Math>
__device__ __forceinline__ void consume_and_write(const PagedAttentionParams& p, const SplitWorkspace& ws,
                                                  const CtaWork& w, LaneQueryRows& rows, int consumer,
                                                  const int4* warp_ranges, int first_tile, int num_tiles,
                                                  uint8_t* smem) {
  using S = Stages<C, D, kFp8Math>;
  WarpgroupRange range{INT_MAX, INT_MIN, INT_MIN, INT_MAX};
#pragma unroll
  for (int x = 0; x < kWarpgroupThreads / 32; ++x) {
    const int4 r = warp_ranges[x];
    range.lo = min(range.lo, r.x), range.hi = max(range.hi, r.y);
    range.interior_lo = max(range.interior_lo, r.z), range.interior_hi = min(range.interior_hi, r.w);
  }
  const int t = threadIdx.x % 4;
  const bool query_bf16 = p.query_dtype == DType::kBFloat16;  // also the output's
  ConsumerMath<C, D, kFp8Math> math;
  math.load(p, rows, w.kv_head, t, query_bf16, smem + S::kQueryOffset + consumer * (S::kQueryBytes / kConsumers));
  WarpState<D> st;
  consume<D>(consumer, rows, range, math, p.logits_soft_cap, first_tile, num_tiles,
             static_cast<uint32_t>(__cvta_generic_to_shared(smem)), st);
  sum_row_shares(st);
  write_rows<C, D>(p, ws, blockIdx.y, w, rows, t, query_bf16, st);
}

// Registers per thread after the split (the launch gives 65536 / kThreads = 168 each): the consumers
// hold O (D / 2), S (kKeys / 2), two P (kKeys / 4 each) and, up to head size 128, Q (D / 4) fragments;
// the producer's unrolled page copies spill below about 100. In FP8 math the consumers also hold the
// partial sum (D / 2) while Q and P take half the registers, and the producer copies K without
// registers: it gives up more.
template <int D, bool kFp8Math>
struct RegisterSplit {
  static constexpr int kProducer = kFp8Math ? 56 : D <= 128 ? 104 : 88;
  static constexpr int kConsumer = kFp8Math ? 224 : D <= 128 ? 200 : 208;
  // setmaxnreg.inc waits until the registers are free: the split must fit what the launch allocated.
  static_assert(kWarpgroupThreads * (kProducer + kConsumers * kConsumer) <= kThreads * (65536 / kThreads / 8 * 8),
                "register split");
};

// Grid as the sm80 kernel's (query tiles of kRows, splits, KV heads x head chunks), one CTA per SM.
template <DType C, int D, bool kFp8Math>
__global__ void __launch_bounds__(kThreads, 1)
    sm90a_kernel(const PagedAttentionParams p, SplitWorkspace ws, int split_tokens) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kProducerWarps = kWarpgroupThreads / 32;
  const int warpgroup = threadIdx.x / kWarpgroupThreads, lane = threadIdx.x % 32;
  // Consumer warp x owns rows 16x ..; the producer runs cta_work too (it needs the CTA's range) and
  // ignores its rows.
  const int row_warp = max(0, static_cast<int>(threadIdx.x / 32) - kProducerWarps);
  CtaWork w;
  LaneQueryRows rows;
  if (!cta_work<kRows, kThreads, false>(p, blockIdx.y, split_tokens, row_warp, w, rows)) return;
  __shared__ int4 warp_ranges[kRows / kWarpRows];
  if (warpgroup > 0 && lane == 0) {
    warp_ranges[row_warp] = make_int4(w.warp_lo, w.warp_hi, w.interior_lo, w.interior_hi);
  }
  __syncthreads();

  extern __shared__ __align__(16) uint8_t sm90a_smem[];
  const uint32_t smem_start = static_cast<uint32_t>(__cvta_generic_to_shared(sm90a_smem));
  const uint32_t padding = (wgmma::kSwizzleAtomBytes - smem_start % wgmma::kSwizzleAtomBytes) % wgmma::kSwizzleAtomBytes;
  constexpr int kKeys = Stages<C, D, kFp8Math>::kKeys;
  const int first_tile = w.lo / kKeys * kKeys;
  const int num_tiles = w.hi > w.lo ? (w.hi - first_tile + kKeys - 1) / kKeys : 0;
  if (warpgroup == 0) {
    wgmma::release_registers<RegisterSplit<D, kFp8Math>::kProducer>();
    produce<C, D, kFp8Math>(p, w, first_tile, num_tiles, sm90a_smem + padding);
  } else {
    wgmma::claim_registers<RegisterSplit<D, kFp8Math>::kConsumer>();
    consume_and_write<C, D, kFp8Math>(p, ws, w, rows, warpgroup - 1,
                                      warp_ranges + (warpgroup - 1) * (kWarpgroupThreads / 32), first_tile,
                                      num_tiles, sm90a_smem + padding);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // code for another architecture: the planner never launches it there
#endif
}

// The kernel of math kFp8Math for head size `head_size`, with its dynamic shared memory, as fn(kernel,
// smem_bytes); `unsupported` for a head size or cache format without one.
template <DType C, bool kFp8Math, typename Result, typename Fn>
Result with_kernel(int head_size, Result unsupported, Fn&& fn) {
  if constexpr (kFp8Math) {
    if constexpr (C == DType::kFloat8E4M3FN || C == DType::kFloat8E5M2) {
      return dispatch<kCudaSm90aFp8MathHeadSizes>(head_size, unsupported, [&](auto head) {
        constexpr int kHead = decltype(head)::value;
        return fn(sm90a_kernel<C, kHead, true>, Stages<C, kHead, true>::kSmemBytes);
      });
    }
    return unsupported;
  } else {
    return dispatch<kCudaSm90aHeadSizes>(head_size, unsupported, [&](auto head) {
      constexpr int kHead = decltype(head)::value;
      return fn(sm90a_kernel<C, kHead, false>, Stages<C, kHead>::kSmemBytes);
    });
  }
}

template <DType C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                   cudaStream_t stream) {
  auto run = [&](auto kernel, int smem_bytes) {
    return launch_grid<kRows>(kernel, kThreads, smem_bytes, p, plan, ws, stream);
  };
  return plan.kernel == AttentionKernel::kMultiTokenSm90aFp8Math
             ? with_kernel<C, true>(p.head_size, cudaErrorInvalidValue, run)
             : with_kernel<C, false>(p.head_size, cudaErrorInvalidValue, run);
}

template <DType C>
int occupancy(int head_size, bool fp8_math) {
  auto resident = [](auto kernel, int smem_bytes) {
    return kernel_occupancy(reinterpret_cast<const void*>(kernel), kThreads, smem_bytes, smem_bytes);
  };
  return fp8_math ? with_kernel<C, true>(head_size, 0, resident) : with_kernel<C, false>(head_size, 0, resident);
}

}  // namespace fp8kv::cuda::multi_token::sm90a
