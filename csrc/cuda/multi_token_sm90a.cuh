// CUDA paged attention for multi-token queries on Hopper (sm_90a): warp-specialized, with warpgroup
// MMAs. A producer warpgroup stages each K/V tile with cp.async (FP8 tiles into a raw ring, then
// converted to 16-bit operands in the swizzled layout the tensor cores read; 16-bit tiles straight
// into that layout) and hands it over through named barriers; two consumer warpgroups of 64 query
// rows each compute S = Q K^T and O += P V as warpgroup MMAs with P in registers (Q too up to head
// size 128; above, in shared memory), and the softmax step of multi_token.cuh between them, pipelined
// one tile deep and taking turns (ping-pong) so that softmax overlaps MMAs, while the producer's
// conversion overlaps both. Design: docs/cuda_prefill_design.md.
#pragma once

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

// Tiles and shared-memory geometry. An operand (the K or the V of one tile) is D / 64 regions of kKeys
// swizzled rows, dims 64h .. 64h + 63 in region h; a stage holds K, then V. Above head size 128, O's
// D / 2 registers leave no room for Q's D / 4: each consumer's Q is staged in shared memory once (the
// same swizzled regions, of its 64 rows), and tiles have 32 keys so that it fits there beside the
// stages.
template <DType C, int D>
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

// The producer warpgroup: stages tiles first_tile, first_tile + kKeys, ... (num_tiles of them) and
// publishes each on both consumers' full barriers of its stage once its operands are in shared memory.
template <DType C, int D>
__device__ __forceinline__ void produce(const PagedAttentionParams& p, const CtaWork& w, int first_tile,
                                       int num_tiles, uint8_t* smem) {
  using S = Stages<C, D>;
  constexpr int kKeys = S::kKeys;
  const int32_t* table_row = p.block_tables + w.seq * p.block_table_stride;
  uint8_t* raw = smem + S::kStages * S::kStageBytes;
  // Warpgroup 0: threads 0 .. kWarpgroupThreads - 1 stage the tiles.
  auto stage = [&](int tile, uint8_t* dst) {
    stage_tile<C, D, kKeys, kWarpgroupThreads>(
        p, w, table_row, first_tile + tile * kKeys, dst,
        [](int key, int chunk) { return static_cast<int>(swizzled_operand_offset<kKeys>(key, chunk)); },
        S::kOperandBytes);
  };
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
  copy_async_wait<0>();
}

// Positions a consumer warpgroup's rows see: any row [lo, hi), every row [interior_lo, interior_hi).
struct WarpgroupRange {
  int lo, hi, interior_lo, interior_hi;
};

// Q, the A operand of a consumer's S = Q K^T (its 64 rows): the lane's fragments in registers, or,
// where Stages::kQueryInSmem, staged once into the consumer's swizzled region of shared memory.
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
    const uint32_t at = region + step / 4 * kRegionBytes + step % 4 * 32;  // as K's, see consume
    wgmma::mma_smem_a<kBf16>(s, wgmma::descriptor(at, 16, wgmma::kSwizzleAtomBytes), key_desc, step > 0);
  }
};

// Consumer `consumer`: it attends to every tile the producer publishes, into st (the tiles its rows do
// not see are masked). Pipelined one tile deep: tile k's S = Q K^T and tile k - 1's O += P V are
// issued together, and tile k's softmax runs while the latter is in flight; a stage is released (when
// the producer will refill it) once its P V is done. Ping-pong (as FlashAttention-3): the consumers
// take turns issuing their MMAs, so that one's softmax runs while the tensor cores work through the
// other's MMAs rather than both at once.
template <DType C, int D>
__device__ __forceinline__ void consume(int consumer, const LaneQueryRows& rows, const WarpgroupRange& range,
                                       const QueryOperand<C, D>& q, float multiplier, float soft_cap,
                                       int first_tile, int num_tiles, uint32_t smem, WarpState<D>& st) {
  using S = Stages<C, D>;
  constexpr int kKeys = S::kKeys;
  constexpr bool kBf16 = CacheTraits<C>::kBf16Math;

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
  auto issue_scores = [&](int k, float (&s)[kKeys / 8][4]) {
    const uint32_t key_smem = smem + k % S::kStages * S::kStageBytes;
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
      // K is K-major (dims contiguous): a step's 16 dims are 32 bytes into the swizzled rows of
      // region step / 4; 8-key groups are one swizzle period apart.
      const uint32_t at = key_smem + step / 4 * S::kRegionBytes + step % 4 * 32;
      q.template issue_scores<kBf16>(s, step, wgmma::descriptor(at, 16, wgmma::kSwizzleAtomBytes));
    }
    wgmma::commit();
  };
  constexpr int kOutputMmas = (D + 127) / 128;  // an MMA's N is at most 128
  constexpr int kOutputTiles = D / 8 / kOutputMmas;  // O's n-tiles per MMA
  auto issue_values = [&](int k, const uint32_t (&p)[kKeys / 16][4]) {
    const uint32_t value_smem = smem + k % S::kStages * S::kStageBytes + S::kOperandBytes;
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
    wgmma::commit();
  };
  auto softmax = [&](int k, float (&s)[kKeys / 8][4], uint32_t (&p)[kKeys / 16][4], float (&rescale)[2]) {
    const int start = first_tile + k * kKeys;
    const bool interior = start >= range.interior_lo && start + kKeys <= range.interior_hi;
    softmax_step<kBf16, D>(s, st, rows, start, interior, multiplier, soft_cap, p, rescale);
  };

  // Tile k - 1's P is read by its P V while tile k's softmax writes the other buffer: two P buffers,
  // swapped by unrolling (a copy from one to the other would be a register write the in-flight MMA
  // depends on, and the compiler would serialize the MMAs around it).
  using Fragments = uint32_t[kKeys / 16][4];
  float s[kKeys / 8][4];
  float rescale[2];
  auto iteration = [&](int k, Fragments& p, Fragments& p_next) {
    acquire(k);
    wgmma::pin(p);  // every register the MMAs read is final before they start
    wgmma::pin(st.acc);
    take_turn();
    wgmma::fence();
    issue_scores(k, s);
    issue_values(k - 1, p);
    pass_turn(false);
    wgmma::wait<1>();  // S of tile k (committed first)
    wgmma::pin(s);
    softmax(k, s, p_next, rescale);
    wgmma::wait<0>();  // O += P V of tile k - 1
    wgmma::pin(st.acc);
    wgmma::pin(p);
    release(k - 1);
    rescale_output(st, rescale);
  };
  auto finish = [&](Fragments& p) {
    wgmma::pin(p);
    wgmma::pin(st.acc);
    take_turn();
    wgmma::fence();
    issue_values(num_tiles - 1, p);
    pass_turn(true);
    wgmma::wait<0>();
    wgmma::pin(st.acc);
    wgmma::pin(p);
    release(num_tiles - 1);
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
    Fragments p0, p1;
    acquire(0);
    take_turn();
    wgmma::fence();
    issue_scores(0, s);
    pass_turn(false);
    wgmma::wait<0>();
    wgmma::pin(s);
    softmax(0, s, p0, rescale);
    rescale_output(st, rescale);
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
// query fragments, the tiles, and the epilogue.
template <DType C, int D>
__device__ __forceinline__ void consume_and_write(const PagedAttentionParams& p, const SplitWorkspace& ws,
                                                  const CtaWork& w, LaneQueryRows& rows, int consumer,
                                                  const int4* warp_ranges, int first_tile, int num_tiles,
                                                  uint8_t* smem) {
  using S = Stages<C, D>;
  WarpgroupRange range{INT_MAX, INT_MIN, INT_MIN, INT_MAX};
#pragma unroll
  for (int x = 0; x < kWarpgroupThreads / 32; ++x) {
    const int4 r = warp_ranges[x];
    range.lo = min(range.lo, r.x), range.hi = max(range.hi, r.y);
    range.interior_lo = max(range.interior_lo, r.z), range.interior_hi = min(range.interior_hi, r.w);
  }
  const int t = threadIdx.x % 4;
  const bool query_bf16 = p.query_dtype == DType::kBFloat16;  // also the output's
  QueryOperand<C, D> q;
  q.load(p, rows, w.kv_head, t, query_bf16, smem + S::kQueryOffset + consumer * (S::kQueryBytes / kConsumers));
  WarpState<D> st;
  consume<C, D>(consumer, rows, range, q, logit_multiplier<C>(p, w.kv_head), p.logits_soft_cap, first_tile, num_tiles,
                static_cast<uint32_t>(__cvta_generic_to_shared(smem)), st);
  sum_row_shares(st);
  write_rows<C, D>(p, ws, blockIdx.y, w, rows, t, query_bf16, st);
}

// Registers per thread after the split (the launch gives 65536 / kThreads = 168 each): the consumers
// hold O (D / 2), S (kKeys / 2), two P (kKeys / 4 each) and, up to head size 128, Q (D / 4) fragments;
// the producer's unrolled page copies spill below about 100.
template <int D>
struct RegisterSplit {
  static constexpr int kProducer = D <= 128 ? 104 : 88;
  static constexpr int kConsumer = D <= 128 ? 200 : 208;
  // setmaxnreg.inc waits until the registers are free: the split must fit what the launch allocated.
  static_assert(kWarpgroupThreads * (kProducer + kConsumers * kConsumer) <= kThreads * (65536 / kThreads / 8 * 8),
                "register split");
};

// Grid as the sm80 kernel's (query tiles of kRows, splits, KV heads x head chunks), one CTA per SM.
template <DType C, int D>
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
  constexpr int kKeys = Stages<C, D>::kKeys;
  const int first_tile = w.lo / kKeys * kKeys;
  const int num_tiles = w.hi > w.lo ? (w.hi - first_tile + kKeys - 1) / kKeys : 0;
  if (warpgroup == 0) {
    wgmma::release_registers<RegisterSplit<D>::kProducer>();
    produce<C, D>(p, w, first_tile, num_tiles, sm90a_smem + padding);
  } else {
    wgmma::claim_registers<RegisterSplit<D>::kConsumer>();
    consume_and_write<C, D>(p, ws, w, rows, warpgroup - 1, warp_ranges + (warpgroup - 1) * (kWarpgroupThreads / 32),
                            first_tile, num_tiles, sm90a_smem + padding);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // code for another architecture: the planner never launches it there
#endif
}

template <DType C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                   cudaStream_t stream) {
  return dispatch<kCudaSm90aHeadSizes>(p.head_size, cudaErrorInvalidValue, [&](auto head) {
    constexpr int kHead = decltype(head)::value;
    return launch_grid<kRows>(sm90a_kernel<C, kHead>, kThreads, Stages<C, kHead>::kSmemBytes, p, plan, ws, stream);
  });
}

template <DType C>
int occupancy(int head_size) {
  return dispatch<kCudaSm90aHeadSizes>(head_size, 0, [](auto head) {
    constexpr int kHead = decltype(head)::value;
    constexpr int kSmemBytes = Stages<C, kHead>::kSmemBytes;
    return kernel_occupancy(reinterpret_cast<const void*>(sm90a_kernel<C, kHead>), kThreads, kSmemBytes, kSmemBytes);
  });
}

}  // namespace fp8kv::cuda::multi_token::sm90a
