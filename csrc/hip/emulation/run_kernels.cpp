// Runs the HIP kernels' unmodified sources on the host (hip/hip_runtime.h beside this file emulates
// the HIP they use) and checks them against independent references built here:
//   - reshape_and_cache: every cache byte equals fp8_encode(x / scale) of the shared codec (the CPU
//     backend's formula) or the copied bits, untouched slots keep their fill; with the rotated recipe,
//     fp8_encode(transform_row(x) / scale), transform_row being the CPU backend's contract code;
//   - kv_amax: equals the exact maximum of |x| (NaN if any input is NaN) folded into the running value;
//   - paged_attention: within a stated tolerance of float64 attention over the dequantized cache, with
//     stale slots holding NaN codes, padded decode rows exactly zero; with the rotated recipe, float64
//     attention of the query rotated by the Hadamard matrix's definition, rotated back the same way.
// Built and run by scripts/check_hip_sources.sh. Prints one line per failure and a summary.
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../../fp8.h"
#include "../../float_conversions.h"
#include "../../gpu/kernels.h"
#include "../../hadamard.h"

namespace fp8kv {
namespace {

int passed = 0;
int failed = 0;

void report(bool ok, const std::string& name, const std::string& detail) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED %s: %s\n", name.c_str(), detail.c_str());
  }
}

// Typed access to raw element buffers.
float load(DType t, const uint8_t* base, int64_t i) {
  switch (t) {
    case DType::kFloat16: { uint16_t h; std::memcpy(&h, base + 2 * i, 2); return half_to_float(h); }
    case DType::kBFloat16: { uint16_t b; std::memcpy(&b, base + 2 * i, 2); return bf16_to_float(b); }
    case DType::kFloat32: { float f; std::memcpy(&f, base + 4 * i, 4); return f; }
    case DType::kFloat8E4M3FN: return fp8_decode<DType::kFloat8E4M3FN>(base[i]);
    case DType::kFloat8E5M2: return fp8_decode<DType::kFloat8E5M2>(base[i]);
    case DType::kFloat8E4M3FNUZ: return fp8_decode<DType::kFloat8E4M3FNUZ>(base[i]);
  }
  return 0.0f;
}

// Stores x rounded to t (FP8: quantized with the shared encoder, scale 1).
void store(DType t, uint8_t* base, int64_t i, float x) {
  switch (t) {
    case DType::kFloat16: { const uint16_t h = float_to_half(x); std::memcpy(base + 2 * i, &h, 2); return; }
    case DType::kBFloat16: { const uint16_t b = float_to_bf16(x); std::memcpy(base + 2 * i, &b, 2); return; }
    case DType::kFloat32: std::memcpy(base + 4 * i, &x, 4); return;
    case DType::kFloat8E4M3FN: base[i] = fp8_encode<DType::kFloat8E4M3FN>(x); return;
    case DType::kFloat8E5M2: base[i] = fp8_encode<DType::kFloat8E5M2>(x); return;
    case DType::kFloat8E4M3FNUZ: base[i] = fp8_encode<DType::kFloat8E4M3FNUZ>(x); return;
  }
}

std::vector<uint8_t> zeros(DType t, int64_t elements) {
  return std::vector<uint8_t>(static_cast<size_t>(elements * dtype_bytes(t)), 0);
}

// A cache of logical shape [blocks, block_size, heads, head_size] inside a raw buffer.
enum class Layout { kNHD, kHND, kPadded };  // kPadded: odd pitches and base offset, no vector loads

struct Cache {
  std::vector<uint8_t> buffer;
  int64_t offset, block_stride, token_stride, head_stride;  // elements
  DType dtype;

  Cache(DType t, Layout layout, int blocks, int block_size, int heads, int head_size) : dtype(t) {
    int64_t elements = 0;
    switch (layout) {
      case Layout::kNHD:
        offset = 0, head_stride = head_size, token_stride = heads * head_stride, block_stride = block_size * token_stride;
        break;
      case Layout::kHND:
        offset = 0, token_stride = head_size, head_stride = block_size * token_stride, block_stride = heads * head_stride;
        break;
      case Layout::kPadded:
        offset = 1, head_stride = head_size + 1, token_stride = heads * head_stride + 3,
        block_stride = block_size * token_stride + 5;
        break;
    }
    elements = offset + blocks * block_stride;
    buffer.assign(static_cast<size_t>(elements * dtype_bytes(t)), 0);
  }
  int64_t index(int64_t block, int64_t token, int64_t head, int64_t d) const {
    return offset + block * block_stride + token * token_stride + head * head_stride + d;
  }
  CacheView view() {
    return CacheView{buffer.data() + offset * dtype_bytes(dtype), block_stride, token_stride, head_stride};
  }
};

// The NaN code of a cache dtype: what a stale slot may hold.
void fill_nan(Cache& c) {
  for (int64_t i = 0; i < static_cast<int64_t>(c.buffer.size()) / dtype_bytes(c.dtype); ++i) {
    store(c.dtype, c.buffer.data(), i, std::nanf(""));
  }
}

// The key / value operands of CacheWriteParams or AmaxParams: two buffers with the same strides.
void describe_key_value(KeyValueInput& p, const std::vector<uint8_t>& key, const std::vector<uint8_t>& value, DType t,
                        int64_t token_stride, int64_t head_stride) {
  p.key = key.data();
  p.value = value.data();
  p.src_dtype = t;
  p.key_token_stride = p.value_token_stride = token_stride;
  p.key_head_stride = p.value_head_stride = head_stride;
}

// The cache recipes of docs/rotated_cache.md: what a cache write applies and attention undoes.
enum class Recipe { kPlain, kRotated, kRotatedCentred, kCentred };  // kCentred: a K offset alone

bool rotates(Recipe r) { return r == Recipe::kRotated || r == Recipe::kRotatedCentred; }
bool centres(Recipe r) { return r == Recipe::kRotatedCentred || r == Recipe::kCentred; }

std::string recipe_name(Recipe r) {
  switch (r) {
    case Recipe::kPlain: return "plain";
    case Recipe::kRotated: return "rotated";
    case Recipe::kRotatedCentred: return "rotated+centred";
    case Recipe::kCentred: return "centred";
  }
  return "?";
}

// x times the rotated recipe's matrix H in float64, from its definition (docs/rotated_cache.md): blocks
// of b elements, b the largest power of two dividing the size but at most 256, with entries
// (-1)^popcount(i & j) / sqrt(b). H is symmetric and orthonormal, so it also rotates back.
std::vector<double> hadamard_f64(const std::vector<double>& x) {
  const int n = static_cast<int>(x.size());
  int b = 1;
  while (n % (2 * b) == 0 && b < 256) b *= 2;
  std::vector<double> y(n, 0.0);
  for (int i = 0; i < n; ++i) {
    const int first = i / b * b;
    for (int j = 0; j < b; ++j) {
      y[i] += (std::popcount(static_cast<unsigned>((i - first) & j)) % 2 == 0 ? 1.0 : -1.0) * x[first + j];
    }
    y[i] /= std::sqrt(static_cast<double>(b));
  }
  return y;
}

std::mt19937_64 rng(20260521);

float normal(float sigma) { return std::normal_distribution<float>(0.0f, sigma)(rng); }

// ---------------------------------------------------------------------------------------------------
// reshape_and_cache

// The midpoint of two neighbouring finite values of an FP8 dtype, random sign: a rounding tie. Its few
// significant bits times a scale of 7 * 2^k stay exact in every source dtype, and 1/7 is inexact
// enough in fp32 that multiplying by a reciprocal instead of dividing misses some ties.
float tie(DType t) {
  while (true) {
    const int code = std::uniform_int_distribution<int>(0, 0x7D)(rng);
    uint8_t a = static_cast<uint8_t>(code), b = static_cast<uint8_t>(code + 1);
    const float lo = load(t, &a, 0), hi = load(t, &b, 0);
    if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
    return (rng() & 1 ? -0.5f : 0.5f) * (lo + hi);
  }
}

// Draws a float32 K or V row (base[first, first + head_size)) until its cache bytes depend on the
// fp32 roundings of the rotation: some element's code differs from that of its float64 value, so
// butterflies in another order would likely store other bytes. A shared value 2^12 times the spread of
// the rest, which the butterflies cancel, leaves rounding errors of about 2^-12 of the results: a few
// draws suffice. False if 100 did not. (Rows of 16-bit values mostly sum exactly in fp32.)
bool draw_rounding_sensitive_row(DType cache_t, uint8_t* base, int64_t first, int head_size, float sigma,
                                 const float* offset, float scale) {
  std::vector<float> row(head_size);
  std::vector<double> exact(head_size);
  for (int draw = 0; draw < 100; ++draw) {
    const float shared = normal(4096.0f * sigma);
    for (int d = 0; d < head_size; ++d) {
      exact[d] = row[d] = shared + normal(sigma);
      store(DType::kFloat32, base, first + d, row[d]);
    }
    transform_row(row.data(), head_size, true, offset);
    exact = hadamard_f64(exact);
    for (int d = 0; d < head_size; ++d) {
      uint8_t stored = 0, rounded_once = 0;
      store(cache_t, &stored, 0, row[d] / scale);
      store(cache_t, &rounded_once, 0, static_cast<float>((exact[d] - (offset != nullptr ? offset[d] : 0.0)) / scale));
      if (stored != rounded_once) return true;
    }
  }
  return false;
}

void check_cache_write(DType src_t, DType cache_t, Layout layout, int head_size, bool per_head,
                       Recipe recipe = Recipe::kPlain) {
  const int heads = 3, block_size = 5, blocks = 7, tokens = 23;
  const std::string name = std::string("reshape_and_cache ") + dtype_name(src_t) + "->" + dtype_name(cache_t) +
                           " layout " + std::to_string(static_cast<int>(layout)) + " d" + std::to_string(head_size) +
                           (per_head ? " per-head " : " per-tensor ") + recipe_name(recipe);
  // A rotation spreads an element over its whole block: non-finite values only in token 0 keep the
  // other rows finite, and exact ties of the division (which the plain cases check, through the same
  // QuantizeTo::encode) do not survive it. With float32 sources, rows whose bytes depend on the fp32
  // roundings (head 1 of every token after the first) check the order of the butterflies instead.
  const bool transformed = recipe != Recipe::kPlain;
  const bool order_checked = rotates(recipe) && src_t == DType::kFloat32;
  // key/value rows with a gap between tokens (slices of a fused QKV tensor).
  const int64_t token_stride = heads * head_size + (layout == Layout::kPadded ? 1 : head_size);
  std::vector<uint8_t> key = zeros(src_t, tokens * token_stride), value = zeros(src_t, tokens * token_stride);
  std::vector<float> k_scale(per_head ? heads : 1), v_scale(per_head ? heads : 1);
  for (size_t h = 0; h < k_scale.size(); ++h) k_scale[h] = std::ldexp(0.4375f, h), v_scale[h] = std::ldexp(0.4375f, -10 - h);
  for (int64_t i = 0; i < tokens * token_stride; ++i) {
    // Values across the FP8 range, some past it, a few non-finite, and exact ties (x / scale halfway
    // between two FP8 values: only a correctly rounded division then rounds to the even code).
    const float special[] = {INFINITY, -INFINITY, std::nanf(""), 1e6f, -0.0f};
    const int h = static_cast<int>(i % token_stride / head_size) % heads;
    if (i % 53 == 7 && (!transformed || i < token_stride)) {
      store(src_t, key.data(), i, special[i % 5]);
      store(src_t, value.data(), i, special[(i + 2) % 5]);
    } else if (i % 3 == 1 && is_fp8(cache_t) && !transformed) {
      store(src_t, key.data(), i, tie(cache_t) * k_scale[per_head ? h : 0]);
      store(src_t, value.data(), i, tie(cache_t) * v_scale[per_head ? h : 0]);
    } else {
      store(src_t, key.data(), i, normal(100.0f));
      store(src_t, value.data(), i, normal(0.01f));
    }
  }
  std::vector<float> k_offset(centres(recipe) ? heads * head_size : 0);
  for (float& mu : k_offset) mu = normal(50.0f);
  int sensitive_rows = 0;
  for (int t = 1; t < tokens && order_checked; ++t) {
    const int h = 1;
    const float* offset = centres(recipe) ? &k_offset[h * head_size] : nullptr;
    const int64_t first = t * token_stride + h * head_size;
    sensitive_rows += draw_rounding_sensitive_row(cache_t, key.data(), first, head_size, 100.0f, offset,
                                                  k_scale[per_head ? h : 0]);
    sensitive_rows += draw_rounding_sensitive_row(cache_t, value.data(), first, head_size, 0.01f, nullptr,
                                                  v_scale[per_head ? h : 0]);
  }
  Cache key_cache(cache_t, layout, blocks, block_size, heads, head_size);
  Cache value_cache(cache_t, layout, blocks, block_size, heads, head_size);
  for (auto* c : {&key_cache, &value_cache}) std::fill(c->buffer.begin(), c->buffer.end(), 0xA5);
  std::vector<int64_t> slots(tokens);
  std::vector<int64_t> order(blocks * block_size);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::shuffle(order.begin(), order.end(), rng);
  for (int t = 0; t < tokens; ++t) slots[t] = t % 6 == 5 ? -1 : order[t];

  std::vector<uint8_t> expected_k = key_cache.buffer, expected_v = value_cache.buffer;
  const int bytes = dtype_bytes(cache_t);
  std::vector<float> k_row(head_size), v_row(head_size);
  for (int t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < head_size; ++d) {
        k_row[d] = load(src_t, key.data(), t * token_stride + h * head_size + d);
        v_row[d] = load(src_t, value.data(), t * token_stride + h * head_size + d);
      }
      transform_row(k_row.data(), head_size, rotates(recipe), centres(recipe) ? &k_offset[h * head_size] : nullptr);
      transform_row(v_row.data(), head_size, rotates(recipe), nullptr);
      for (int d = 0; d < head_size; ++d) {
        const int64_t src = t * token_stride + h * head_size + d;
        const int64_t dst = key_cache.index(slots[t] / block_size, slots[t] % block_size, h, d);
        if (is_fp8(cache_t)) {
          store(cache_t, expected_k.data(), dst, k_row[d] / k_scale[per_head ? h : 0]);
          store(cache_t, expected_v.data(), dst, v_row[d] / v_scale[per_head ? h : 0]);
        } else {
          std::memcpy(&expected_k[dst * bytes], &key[src * bytes], bytes);
          std::memcpy(&expected_v[dst * bytes], &value[src * bytes], bytes);
        }
      }
    }
  }

  CacheWriteParams p{};
  describe_key_value(p, key, value, src_t, token_stride, head_size);
  p.key_cache = key_cache.view();
  p.value_cache = value_cache.view();
  p.cache_dtype = cache_t;
  p.slot_mapping = slots.data();
  p.num_slots = tokens;
  p.k_scale = HeadScalars{k_scale.data(), per_head};
  p.v_scale = HeadScalars{v_scale.data(), per_head};
  p.transform = CacheTransform{rotates(recipe), centres(recipe) ? k_offset.data() : nullptr};
  p.num_kv_heads = heads;
  p.head_size = head_size;
  p.block_size = block_size;
  const hipError_t status = gpu::reshape_and_cache(p, nullptr);
  int64_t mismatches = 0;
  for (size_t i = 0; i < expected_k.size(); ++i) {
    mismatches += expected_k[i] != key_cache.buffer[i];
    mismatches += expected_v[i] != value_cache.buffer[i];
  }
  const int wanted_rows = order_checked ? 2 * (tokens - 1) : 0;
  std::string detail = std::to_string(mismatches) + " bytes differ";
  if (order_checked) {
    detail += ", " + std::to_string(sensitive_rows) + " of " + std::to_string(wanted_rows) +
              " rounding-sensitive rows drawn";
  }
  report(status == hipSuccess && mismatches == 0 && sensitive_rows == wanted_rows, name, detail);
}

// ---------------------------------------------------------------------------------------------------
// kv_amax

void check_amax(DType src_t, int tokens, int head_size, bool per_head, bool with_nan, bool padded) {
  const int heads = 5;
  const std::string name = std::string("kv_amax ") + dtype_name(src_t) + " tokens " + std::to_string(tokens) + " d" +
                           std::to_string(head_size) + (per_head ? " per-head" : " per-tensor") +
                           (with_nan ? " nan" : "") + (padded ? " padded" : "");
  const int64_t head_stride = head_size + (padded ? 1 : 0);
  const int64_t token_stride = heads * head_stride + (padded ? 3 : 0);
  std::vector<uint8_t> key = zeros(src_t, tokens * token_stride + 1), value = zeros(src_t, tokens * token_stride + 1);
  for (int64_t i = 0; i < tokens * token_stride; ++i) {
    store(src_t, key.data(), i, normal(3.0f) * (i % 97 == 3 ? 50.0f : 1.0f));
    store(src_t, value.data(), i, normal(0.5f));
  }
  if (with_nan) store(src_t, value.data(), (tokens - 1) * token_stride + 2 * head_stride + head_size - 1, std::nanf(""));
  std::vector<float> k_amax(per_head ? heads : 1), v_amax(per_head ? heads : 1);
  for (size_t h = 0; h < k_amax.size(); ++h) k_amax[h] = h == 1 ? 1e4f : 0.5f, v_amax[h] = 0.0f;

  auto expected = [&](const std::vector<uint8_t>& x, const std::vector<float>& running) {
    std::vector<double> head_max(heads, 0.0);
    std::vector<bool> head_nan(heads, false);
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        for (int d = 0; d < head_size; ++d) {
          const float v = load(src_t, x.data(), t * token_stride + h * head_stride + d);
          if (std::isnan(v)) head_nan[h] = true;
          head_max[h] = std::max(head_max[h], static_cast<double>(std::fabs(v)));
        }
      }
    }
    std::vector<float> result = running;
    for (int h = 0; h < heads; ++h) {
      float& r = result[per_head ? h : 0];
      r = (head_nan[h] || std::isnan(r)) ? std::nanf("") : std::max(r, static_cast<float>(head_max[h]));
    }
    return result;
  };
  const std::vector<float> want_k = expected(key, k_amax), want_v = expected(value, v_amax);

  AmaxParams p{};
  describe_key_value(p, key, value, src_t, token_stride, head_stride);
  p.num_tokens = tokens;
  p.num_kv_heads = heads;
  p.head_size = head_size;
  p.k_amax = HeadScalars{k_amax.data(), per_head};
  p.v_amax = HeadScalars{v_amax.data(), per_head};
  const hipError_t status = gpu::kv_amax(p, nullptr);
  bool ok = status == hipSuccess;
  std::string detail;
  for (size_t h = 0; h < k_amax.size(); ++h) {
    for (auto [got, want] : {std::pair{k_amax[h], want_k[h]}, std::pair{v_amax[h], want_v[h]}}) {
      const bool same = std::isnan(want) ? std::isnan(got) : got == want;  // a maximum is exact
      if (!same) ok = false, detail += " head " + std::to_string(h) + ": " + std::to_string(got) + " != " + std::to_string(want);
    }
  }
  report(ok, name, detail);
}

// ---------------------------------------------------------------------------------------------------
// paged_attention

struct AttentionCase {
  DType query_t;
  DType cache_t;
  int head_size;
  int num_kv_heads;
  int group;
  int block_size;
  std::vector<int> seq_lens;
  std::vector<int> q_lens;  // empty: decode (one row per sequence)
  int sliding_window = -1;
  float soft_cap = 0.0f;
  bool per_head = false;
  Layout layout = Layout::kNHD;
  int compute_units = 4;
  Recipe recipe = Recipe::kPlain;
  bool lse = false;  // also the log-sum-exp output (checked against the reference's)
};

std::string describe(const AttentionCase& c) {
  std::string s = std::string("paged_attention q ") + dtype_name(c.query_t) + " cache " + dtype_name(c.cache_t) +
                  " d" + std::to_string(c.head_size) + " kv" + std::to_string(c.num_kv_heads) + " g" +
                  std::to_string(c.group) + " bs" + std::to_string(c.block_size) + " lens";
  for (int l : c.seq_lens) s += " " + std::to_string(l);
  if (!c.q_lens.empty()) {
    s += " q_lens";
    for (int l : c.q_lens) s += " " + std::to_string(l);
  }
  s += " window " + std::to_string(c.sliding_window) + " cap " + std::to_string(c.soft_cap) +
       (c.per_head ? " per-head" : "") + " layout " + std::to_string(static_cast<int>(c.layout)) + " cus " +
       std::to_string(c.compute_units) + " " + recipe_name(c.recipe) + (c.lse ? " lse" : "");
  return s;
}

void check_attention(const AttentionCase& c) {
  const int num_seqs = static_cast<int>(c.seq_lens.size());
  const int num_heads = c.num_kv_heads * c.group;
  const int d_size = c.head_size;
  const int longest = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int max_blocks_per_seq = (longest + c.block_size - 1) / c.block_size + 1;  // one spare entry per row
  int num_blocks = 1;
  for (int l : c.seq_lens) num_blocks += (l + c.block_size - 1) / c.block_size;

  // Cache: NaN codes everywhere (stale), then real values at each sequence's positions.
  Cache key_cache(c.cache_t, c.layout, num_blocks, c.block_size, c.num_kv_heads, d_size);
  Cache value_cache(c.cache_t, c.layout, num_blocks, c.block_size, c.num_kv_heads, d_size);
  fill_nan(key_cache);
  fill_nan(value_cache);
  std::vector<int32_t> block_ids(num_blocks);
  for (int b = 0; b < num_blocks; ++b) block_ids[b] = b;
  std::shuffle(block_ids.begin(), block_ids.end(), rng);
  std::vector<int32_t> block_tables(static_cast<size_t>(num_seqs) * max_blocks_per_seq, -1);  // -1: never read
  int next = 0;
  for (int s = 0; s < num_seqs; ++s) {
    for (int b = 0; b < (c.seq_lens[s] + c.block_size - 1) / c.block_size; ++b) {
      block_tables[s * max_blocks_per_seq + b] = block_ids[next++];
    }
  }
  std::vector<float> k_scale(c.per_head ? c.num_kv_heads : 1), v_scale(c.per_head ? c.num_kv_heads : 1);
  for (size_t h = 0; h < k_scale.size(); ++h) k_scale[h] = 0.02f * (h + 1), v_scale[h] = 0.015f / (h + 1);
  const bool quantized = is_fp8(c.cache_t);
  // The K offsets the cache was centred by, larger than the keys so that a soft cap would show any
  // error in adding them back.
  std::vector<float> k_offset(centres(c.recipe) ? c.num_kv_heads * d_size : 0);
  for (float& mu : k_offset) mu = normal(2.0f);
  // Dequantized values in the cache's basis (keys with their offset added back), as float64 reference
  // input: [seq][position][kv_head][d].
  std::vector<std::vector<double>> keys(num_seqs), values(num_seqs);
  for (int s = 0; s < num_seqs; ++s) {
    keys[s].resize(static_cast<size_t>(c.seq_lens[s]) * c.num_kv_heads * d_size);
    values[s].resize(keys[s].size());
    for (int t = 0; t < c.seq_lens[s]; ++t) {
      const int32_t block = block_tables[s * max_blocks_per_seq + t / c.block_size];
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const float ks = quantized ? k_scale[c.per_head ? h : 0] : 1.0f;
        const float vs = quantized ? v_scale[c.per_head ? h : 0] : 1.0f;
        for (int d = 0; d < d_size; ++d) {
          const int64_t at = key_cache.index(block, t % c.block_size, h, d);
          store(c.cache_t, key_cache.buffer.data(), at, normal(1.0f) / ks);
          store(c.cache_t, value_cache.buffer.data(), at, normal(1.0f) / vs);
          const size_t i = (static_cast<size_t>(t) * c.num_kv_heads + h) * d_size + d;
          // Attention applies the scales whatever the cache dtype (as the CPU backend does).
          keys[s][i] = static_cast<double>(load(c.cache_t, key_cache.buffer.data(), at)) * k_scale[c.per_head ? h : 0] +
                       (centres(c.recipe) ? k_offset[h * d_size + d] : 0.0);
          values[s][i] = static_cast<double>(load(c.cache_t, value_cache.buffer.data(), at)) * v_scale[c.per_head ? h : 0];
        }
      }
    }
  }

  std::vector<int32_t> cu_seqlens;
  int rows = num_seqs;
  if (!c.q_lens.empty()) {
    cu_seqlens.push_back(0);
    for (int l : c.q_lens) cu_seqlens.push_back(cu_seqlens.back() + l);
    rows = cu_seqlens.back();
  }
  std::vector<uint8_t> query = zeros(c.query_t, static_cast<int64_t>(rows) * num_heads * d_size);
  for (int64_t i = 0; i < static_cast<int64_t>(rows) * num_heads * d_size; ++i) store(c.query_t, query.data(), i, normal(1.0f));
  std::vector<uint8_t> out = zeros(c.query_t, static_cast<int64_t>(rows) * num_heads * d_size);
  for (int64_t i = 0; i < static_cast<int64_t>(rows) * num_heads * d_size; ++i) store(c.query_t, out.data(), i, std::nanf(""));
  const double softmax_scale = 1.0 / std::sqrt(static_cast<double>(d_size));

  PagedAttentionParams p{};
  p.out = out.data();
  p.out_token_stride = num_heads * d_size;
  p.out_head_stride = d_size;
  p.query = query.data();
  p.query_token_stride = num_heads * d_size;
  p.query_head_stride = d_size;
  p.query_dtype = c.query_t;
  p.key_cache = key_cache.view();
  p.value_cache = value_cache.view();
  p.cache_dtype = c.cache_t;
  p.block_tables = block_tables.data();
  p.block_table_stride = max_blocks_per_seq;
  p.max_blocks_per_seq = max_blocks_per_seq;
  std::vector<int32_t> seq_lens(c.seq_lens.begin(), c.seq_lens.end());
  p.seq_lens = seq_lens.data();
  p.cu_seqlens_q = c.q_lens.empty() ? nullptr : cu_seqlens.data();
  p.num_seqs = num_seqs;
  p.num_query_tokens = rows;
  p.num_heads = num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_size = d_size;
  p.block_size = c.block_size;
  p.num_blocks = num_blocks;
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.k_scale = HeadScalars{k_scale.data(), c.per_head};
  p.v_scale = HeadScalars{v_scale.data(), c.per_head};
  p.sliding_window = c.sliding_window;
  p.logits_soft_cap = c.soft_cap;
  p.transform = CacheTransform{rotates(c.recipe), centres(c.recipe) ? k_offset.data() : nullptr};

  const std::string name = describe(c);
  if (const std::string why = gpu::paged_attention_unsupported(p, 0); !why.empty()) {
    report(false, name, why);
    return;
  }
  hip_emulation::compute_units = c.compute_units;
  gpu::AttentionPlan plan{};
  std::vector<float> lse(c.lse ? static_cast<size_t>(rows) * num_heads : 0, std::nanf(""));
  // [num_heads][rows], transposed: a strided output.
  const RowsView lse_view{c.lse ? lse.data() : nullptr, 1, rows};
  hipError_t status = gpu::plan_paged_attention(p, c.lse, 0, &plan);
  std::vector<float> workspace(static_cast<size_t>(plan.workspace_bytes / 4));
  if (status == hipSuccess) status = gpu::paged_attention(p, lse_view, plan, workspace.data(), nullptr);

  // float64 reference and tolerance. Error sources: fp32 dot products, exponentials and sums (relative
  // ~1e-6 at these lengths), then one rounding of the output to the query dtype: half an ulp, 2^-11
  // (fp16) or 2^-8 (bf16) relative. Bound: 1.5 ulp of the reference plus 1e-4 of the largest |v| (in
  // the cache's basis). The rotated recipe adds the fp32 rotations: the query's (relative ~log2(b) *
  // 2^-24 on the logits) and the output's, whose log2(b) stages of sums at most sqrt(b) * |v| large add
  // at most log2(b) * sqrt(b) * 2^-24 |v| (8e-6 |v| for b = 256) and carry the accumulators' errors
  // over at most sqrt(b) = 16 of them (~2e-5 |v|): within the same bound, which the rotated cases
  // share so that they hold the kernel to it. Without a soft cap the reference keeps the K offsets,
  // which softmax ignores.
  const double ulp = c.query_t == DType::kFloat16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  double worst = 0.0;
  std::string detail;
  int bad = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = c.q_lens.empty() ? 1 : c.q_lens[s];
    const int first_row = c.q_lens.empty() ? s : cu_seqlens[s];
    for (int j = 0; j < q_len; ++j) {
      const int row = first_row + j;
      const int hi = c.seq_lens[s] - q_len + j + 1;
      const int lo = c.sliding_window > 0 ? std::max(0, hi - c.sliding_window) : 0;
      for (int head = 0; head < num_heads; ++head) {
        const int kv = head / c.group;
        const int64_t first = (static_cast<int64_t>(row) * num_heads + head) * d_size;
        std::vector<double> q(d_size);
        for (int d = 0; d < d_size; ++d) q[d] = load(c.query_t, query.data(), first + d);
        if (rotates(c.recipe)) q = hadamard_f64(q);  // into the cache's basis
        std::vector<double> logits;
        double max_logit = -INFINITY;
        double v_max = 0.0;
        for (int t = lo; t < hi; ++t) {
          double dot = 0.0;
          const double* key = &keys[s][(static_cast<size_t>(t) * c.num_kv_heads + kv) * d_size];
          for (int d = 0; d < d_size; ++d) dot += q[d] * key[d];
          double logit = dot * softmax_scale;
          if (c.soft_cap > 0) logit = c.soft_cap * std::tanh(logit / c.soft_cap);
          logits.push_back(logit);
          max_logit = std::max(max_logit, logit);
        }
        double sum = 0.0;
        for (double& l : logits) sum += (l = std::exp(l - max_logit));
        if (c.lse) {
          // The reference's logits keep the K offsets (softmax ignores them, the log-sum-exp does not).
          // fp32 logits, exponentials and sums: relative ~1e-6 of the logits' magnitude (~10 here).
          const double want = hi <= lo ? -INFINITY : max_logit + std::log(sum);
          const double got = lse[lse_view.offset(row, head)];
          const bool ok = hi <= lo ? got == -INFINITY : std::fabs(got - want) <= 1e-5 * (1.0 + std::fabs(want));
          if (!ok && ++bad <= 3) {
            detail += " [lse row " + std::to_string(row) + " head " + std::to_string(head) + ": got " +
                      std::to_string(got) + " want " + std::to_string(want) + "]";
          }
        }
        std::vector<double> want(d_size, 0.0);
        for (int d = 0; d < d_size; ++d) {
          for (int t = lo; t < hi; ++t) {
            const double v = values[s][(static_cast<size_t>(t) * c.num_kv_heads + kv) * d_size + d];
            want[d] += logits[t - lo] / sum * v;
            v_max = std::max(v_max, std::fabs(v));
          }
        }
        if (rotates(c.recipe)) want = hadamard_f64(want);  // back to the query's basis
        for (int d = 0; d < d_size; ++d) {
          const double got = load(c.query_t, out.data(), first + d);
          const double err = std::fabs(got - want[d]);
          const bool ok = hi <= lo ? got == 0.0 : err <= 1.5 * ulp * std::fabs(want[d]) + 1e-4 * v_max;
          worst = std::max(worst, err);
          if (!ok && ++bad <= 3) {
            detail += " [row " + std::to_string(row) + " head " + std::to_string(head) + " d " + std::to_string(d) +
                      ": got " + std::to_string(got) + " want " + std::to_string(want[d]) + "]";
          }
        }
      }
    }
  }
  report(status == hipSuccess && bad == 0, name + " splits " + std::to_string(plan.num_splits),
         std::to_string(bad) + " outputs off" + detail);
}

void run_attention_cases() {
  const DType e4m3fn = DType::kFloat8E4M3FN, e5m2 = DType::kFloat8E5M2, fnuz = DType::kFloat8E4M3FNUZ;
  const DType f16 = DType::kFloat16, bf16 = DType::kBFloat16;
  std::vector<AttentionCase> cases;
  // Every cache format with each query dtype, decode, GQA 4, one split per row.
  for (DType q : {f16, bf16}) {
    for (DType cache : {e4m3fn, fnuz, e5m2, q}) cases.push_back({q, cache, 128, 2, 4, 16, {37, 0, 130}, {}});
  }
  // Head sizes (padded lanes for 80, 96, 192, 32) and group sizes (tiles of 1, 2, 4, 8; 12 = two tiles).
  for (int d : {32, 64, 80, 96, 192, 256}) cases.push_back({bf16, fnuz, d, 1, 4, 16, {45, 9}, {}});
  for (int g : {1, 2, 3, 6, 8, 12}) cases.push_back({f16, e4m3fn, 64, 2, g, 16, {70, 3}, {}});
  // Block sizes that do not divide a step (1, 5) and larger than a step (64); layouts incl. unaligned.
  for (int bs : {1, 5, 64}) cases.push_back({f16, fnuz, 64, 1, 2, bs, {90, 17}, {}});
  cases.push_back({bf16, e4m3fn, 128, 2, 2, 16, {50, 33}, {}, -1, 0.0f, true, Layout::kHND});
  cases.push_back({bf16, e4m3fn, 80, 2, 2, 16, {50, 33}, {}, -1, 0.0f, true, Layout::kPadded});
  cases.push_back({f16, f16, 64, 2, 2, 8, {41, 12}, {}, -1, 0.0f, false, Layout::kPadded});
  // Long rows: several LDS chunks, split-KV with a merge (many compute units), windows, soft cap.
  cases.push_back({f16, fnuz, 64, 1, 4, 16, {700, 300, 5}, {}, -1, 0.0f, false, Layout::kNHD, 1});
  cases.push_back({f16, fnuz, 64, 1, 4, 16, {700, 300, 5}, {}, -1, 0.0f, false, Layout::kNHD, 64});
  cases.push_back({bf16, e5m2, 128, 2, 1, 32, {600, 0}, {}, -1, 0.0f, true, Layout::kHND, 64});
  cases.push_back({f16, e4m3fn, 64, 1, 8, 16, {650, 90}, {}, 200, 0.0f, false, Layout::kNHD, 64});
  cases.push_back({f16, e4m3fn, 64, 1, 8, 16, {650, 90}, {}, 200, 0.0f, false, Layout::kNHD, 1});
  cases.push_back({bf16, fnuz, 96, 2, 3, 16, {300, 40}, {}, -1, 5.0f, false, Layout::kNHD, 64});
  cases.push_back({bf16, e4m3fn, 128, 2, 8, 16, {900}, {}, -1, 0.0f, true, Layout::kHND, 1});
  // Multi-token rows (causal; an empty sequence; windows; splits).
  cases.push_back({f16, fnuz, 64, 2, 2, 16, {20, 9, 33}, {4, 0, 7}});
  cases.push_back({bf16, e4m3fn, 128, 1, 4, 5, {40, 12}, {12, 3}, 10, 30.0f, true});
  cases.push_back({f16, e5m2, 64, 1, 2, 16, {520, 300}, {3, 2}, -1, 0.0f, false, Layout::kNHD, 64});
  // The rotated recipes: every rotation block (16 for d80 and d48 .. 256), padded lanes (d80, d192),
  // K offsets with and without a soft cap (small caps, so that a missing offset shows), an offset
  // alone, GQA tiles of 2 to 8 heads, unaligned rows, splits with the merge, decode and multi-token.
  auto with = [](Recipe recipe, AttentionCase c) {
    c.recipe = recipe;
    return c;
  };
  const Recipe rotated = Recipe::kRotated, centred = Recipe::kRotatedCentred, offset_only = Recipe::kCentred;
  cases.push_back(with(rotated, {bf16, fnuz, 128, 2, 4, 16, {37, 0, 130}, {}}));
  cases.push_back(with(centred, {f16, e4m3fn, 64, 2, 8, 16, {70, 3}, {}}));
  cases.push_back(with(centred, {bf16, fnuz, 96, 2, 3, 16, {300, 40}, {}, -1, 5.0f, false, Layout::kNHD, 64}));
  cases.push_back(with(rotated, {f16, e5m2, 256, 1, 2, 16, {45, 9}, {}, -1, 5.0f}));
  cases.push_back(with(centred, {bf16, fnuz, 80, 1, 12, 16, {45, 9}, {}, -1, 5.0f}));
  cases.push_back(with(centred, {bf16, e4m3fn, 192, 2, 2, 16, {50, 33}, {}, -1, 8.0f, true, Layout::kPadded}));
  cases.push_back(with(offset_only, {f16, e4m3fn, 64, 1, 4, 16, {90, 17}, {}, -1, 5.0f}));
  cases.push_back(with(rotated, {f16, fnuz, 64, 1, 4, 16, {700, 300, 5}, {}, -1, 0.0f, false, Layout::kNHD, 64}));
  cases.push_back(with(centred, {bf16, e4m3fn, 128, 1, 4, 5, {40, 12}, {12, 3}, 10, 5.0f, true}));
  cases.push_back(with(rotated, {f16, fnuz, 48, 2, 2, 16, {20, 9, 33}, {4, 0, 7}}));
  cases.push_back(with(centred, {f16, e5m2, 64, 1, 2, 16, {520, 300}, {3, 2}, -1, 5.0f, false, Layout::kNHD, 64}));
  // The log-sum-exp: decode with an empty row, many splits, a window, a soft cap, multi-token rows (an
  // empty sequence), and the recipes, whose K offset the logits leave out without a cap.
  const AttentionCase lse_cases[] = {
      {f16, e4m3fn, 128, 2, 4, 16, {37, 0, 130}, {}},
      {f16, fnuz, 64, 1, 4, 16, {700, 300, 5}, {}, -1, 0.0f, false, Layout::kNHD, 64},
      {f16, e4m3fn, 64, 1, 8, 16, {650, 90}, {}, 200, 0.0f, false, Layout::kNHD, 1},
      {bf16, fnuz, 96, 2, 3, 16, {300, 40}, {}, -1, 5.0f, false, Layout::kNHD, 64},
      {f16, fnuz, 64, 2, 2, 16, {20, 9, 33}, {4, 0, 7}},
      {bf16, bf16, 64, 1, 2, 16, {520, 300}, {3, 2}, 100, 0.0f, true},
      with(centred, {f16, e4m3fn, 64, 2, 8, 16, {70, 0, 3}, {}}),
      with(offset_only, {f16, e4m3fn, 80, 1, 4, 16, {90, 17}, {}, -1, 0.0f, false, Layout::kNHD, 64}),
      with(centred, {bf16, e4m3fn, 128, 1, 4, 5, {40, 12}, {12, 3}, 10, 0.0f, true}),
      with(centred, {bf16, fnuz, 96, 2, 3, 16, {300, 40}, {}, -1, 5.0f, false, Layout::kNHD, 64}),
      with(rotated, {f16, e5m2, 256, 1, 2, 16, {45, 9}, {}}),
  };
  for (AttentionCase c : lse_cases) {
    c.lse = true;
    cases.push_back(c);
  }
  for (const AttentionCase& c : cases) check_attention(c);
}

// merge_attention_states against float64: random states with a spread of log-sum-exps, rows whose one
// side has no keys (-inf, its output NaN, which must not enter) and rows where both have none; out and
// lse strided.
void check_merge_states(DType dtype) {
  const int tokens = 7, heads = 3, d_size = 40, rows = tokens * heads;
  const int64_t out_token_stride = heads * (d_size + 8);  // padded rows
  std::vector<uint8_t> a = zeros(dtype, tokens * out_token_stride), b = zeros(dtype, tokens * out_token_stride);
  std::vector<uint8_t> out = zeros(dtype, tokens * out_token_stride);
  std::vector<float> lse_a(rows), lse_b(rows), lse(2 * rows, std::nanf(""));
  for (int r = 0; r < rows; ++r) {
    lse_a[r] = r % 5 == 1 ? -INFINITY : normal(6.0f);
    lse_b[r] = r % 5 == 2 || r % 7 == 1 ? -INFINITY : normal(6.0f);
    for (int d = 0; d < d_size; ++d) {
      const int64_t at = (r / heads) * out_token_stride + (r % heads) * (d_size + 8) + d;
      store(dtype, a.data(), at, lse_a[r] == -INFINITY ? std::nanf("") : normal(1.0f));
      store(dtype, b.data(), at, lse_b[r] == -INFINITY ? std::nanf("") : normal(1.0f));
      store(dtype, out.data(), at, std::nanf(""));
    }
  }
  MergeStatesParams p{};
  const RowsView outs{nullptr, out_token_stride, d_size + 8};
  p.out = outs, p.out_a = outs, p.out_b = outs;
  p.out.data = out.data(), p.out_a.data = a.data(), p.out_b.data = b.data();
  p.lse = RowsView{lse.data(), 2 * heads, 2};  // every other element
  p.lse_a = RowsView{lse_a.data(), heads, 1};
  p.lse_b = RowsView{lse_b.data(), heads, 1};
  p.dtype = dtype;
  p.num_tokens = tokens, p.num_heads = heads, p.head_size = d_size;
  const hipError_t status = gpu::merge_attention_states(p, nullptr);
  // Bound: the weights' fp32 exponentials and division (a few units of 2^-24 relative, times the log-sum-exps'
  // difference from the exponent's argument), then one rounding to the dtype.
  const double ulp = dtype == DType::kFloat32 ? std::ldexp(1.0, -23) : dtype == DType::kFloat16 ? std::ldexp(1.0, -10)
                                                                                               : std::ldexp(1.0, -7);
  int bad = 0;
  std::string detail;
  for (int r = 0; r < rows; ++r) {
    const double la = lse_a[r], lb = lse_b[r], m = std::max(la, lb);
    const double wa = m == -INFINITY ? 0.0 : std::exp(la - m), wb = m == -INFINITY ? 0.0 : std::exp(lb - m);
    const double want_lse = m == -INFINITY ? -INFINITY : m + std::log(wa + wb);
    const double got_lse = lse[p.lse.offset(r / heads, r % heads)];
    bool ok = m == -INFINITY ? got_lse == -INFINITY : std::fabs(got_lse - want_lse) <= 1e-6 * (2.0 + std::fabs(want_lse));
    for (int d = 0; d < d_size; ++d) {
      const int64_t at = (r / heads) * out_token_stride + (r % heads) * (d_size + 8) + d;
      const double xa = wa == 0.0 ? 0.0 : load(dtype, a.data(), at), xb = wb == 0.0 ? 0.0 : load(dtype, b.data(), at);
      const double want = m == -INFINITY ? 0.0 : (wa * xa + wb * xb) / (wa + wb);
      const double err = std::fabs(load(dtype, out.data(), at) - want);
      const double spread = wa == 0.0 || wb == 0.0 ? 0.0 : std::fabs(la - lb);
      ok = ok && err <= 0.5 * ulp * std::fabs(want) + (spread + 8.0) * std::ldexp(1.0, -24) * (std::fabs(xa) + std::fabs(xb));
    }
    if (!ok && ++bad <= 3) {
      detail += " [row " + std::to_string(r) + ": lse got " + std::to_string(got_lse) + " want " +
                std::to_string(want_lse) + "]";
    }
  }
  report(status == hipSuccess && bad == 0, std::string("merge_attention_states ") + dtype_name(dtype),
         std::to_string(bad) + " rows off" + detail);
}

}  // namespace
}  // namespace fp8kv

int main() {
  using namespace fp8kv;
  const DType sources[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  const DType fp8s[] = {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat8E4M3FNUZ};
  for (DType src : sources) {
    for (DType cache : fp8s) {
      for (Layout layout : {Layout::kNHD, Layout::kHND, Layout::kPadded}) check_cache_write(src, cache, layout, 12, true);
      check_cache_write(src, cache, Layout::kNHD, 6, false);  // head size not a multiple of the vector
    }
    check_cache_write(src, src, Layout::kNHD, 12, false);
    check_cache_write(src, src, Layout::kPadded, 12, true);
  }
  // The rotated recipes' bytes: every format and source dtype, aligned and unaligned rows (kPadded),
  // an offset alone with vector and element accesses; then every rotation block (16 .. 256) and a row
  // of two blocks, from float32 (whose rows check the butterflies' order).
  for (DType src : sources) {
    for (DType cache : fp8s) {
      check_cache_write(src, cache, Layout::kNHD, 128, true, Recipe::kRotatedCentred);
      check_cache_write(src, cache, Layout::kPadded, 48, false, Recipe::kRotated);
      check_cache_write(src, cache, Layout::kHND, 12, true, Recipe::kCentred);
      check_cache_write(src, cache, Layout::kPadded, 6, false, Recipe::kCentred);
    }
  }
  for (int head_size : {16, 32, 64, 96, 256, 512}) {
    check_cache_write(DType::kFloat32, DType::kFloat8E4M3FNUZ, Layout::kHND, head_size, true, Recipe::kRotatedCentred);
  }
  for (DType src : sources) {
    for (bool per_head : {false, true}) {
      check_amax(src, 37, 16, per_head, false, false);
      check_amax(src, 37, 16, per_head, true, false);
      check_amax(src, 300, 6, per_head, false, true);
    }
  }
  run_attention_cases();
  for (DType dtype : sources) check_merge_states(dtype);
  std::printf("hip-emulation: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
