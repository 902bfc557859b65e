#include "op_params.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

#include <c10/util/Exception.h>

#include "hadamard.h"

namespace fp8kv {
namespace {

// The DType of a scalar type, if the kernels know it.
std::optional<DType> as_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Half: return DType::kFloat16;
    case c10::ScalarType::BFloat16: return DType::kBFloat16;
    case c10::ScalarType::Float: return DType::kFloat32;
    case c10::ScalarType::Float8_e4m3fn: return DType::kFloat8E4M3FN;
    case c10::ScalarType::Float8_e5m2: return DType::kFloat8E5M2;
    case c10::ScalarType::Float8_e4m3fnuz: return DType::kFloat8E4M3FNUZ;
    default: return std::nullopt;
  }
}

DType to_dtype(c10::ScalarType t) {
  const std::optional<DType> type = as_dtype(t);
  TORCH_CHECK(type.has_value(), "fp8kv: unsupported dtype ", t);
  return *type;
}

// Whether t is in `types`, one of the supported-dtype lists of dispatch.h.
template <std::size_t N>
bool is_one_of(const DType (&types)[N], c10::ScalarType t) {
  const std::optional<DType> type = as_dtype(t);
  return type.has_value() && contains(types, *type);
}

// The kernels index heads, rows, blocks and positions with int32. A table row may cover at most
// 2^30 tokens, which leaves int32 headroom for every tile end and window bound computed from it.
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxTokensPerSequence = int64_t{1} << 30;

void check_int32(const char* op, const char* name, const char* what, int64_t value) {
  TORCH_CHECK(value <= kMaxInt32, op, ": `", name, "` ", what, " = ", value, " exceeds the int32 limit ", kMaxInt32);
}

// A double scalar that the kernels read as float32: finite, > 0 and still > 0 and finite in float32.
float positive_float32(const char* op, const char* name, double value, const char* none_hint) {
  const float narrowed = static_cast<float>(value);
  TORCH_CHECK(std::isfinite(value) && value > 0 && std::isfinite(narrowed) && narrowed > 0, op, ": `", name,
              "` must be ", none_hint, "a finite positive number representable in float32 (",
              std::numeric_limits<float>::denorm_min(), " to ", std::numeric_limits<float>::max(), "), got ", value);
  return narrowed;
}

// ---------------------------------------------------------------------------- memory overlap

struct Named {
  const char* name;
  const at::Tensor* tensor;
};

const at::Tensor kNoTensor;  // an absent optional input or output

struct Span {  // the bytes a strided tensor can touch: [begin, end)
  const char* begin;
  const char* end;
};

Span byte_span(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const char* begin = static_cast<const char*>(t.data_ptr());
  return Span{begin, begin + (last + 1) * static_cast<int64_t>(t.element_size())};
}

// (stride, size) of the dimensions with more than one element, by increasing stride; empty when the
// layout is not nested, i.e. some stride does not exceed the span of the smaller ones (then elements
// may coincide, and offsets are not decided below).
std::vector<std::pair<int64_t, int64_t>> nested_dims(const at::Tensor& t, bool* nested) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  *nested = true;
  for (const auto& [stride, size] : dims) {
    if (stride <= span) *nested = false;
    span += (size - 1) * stride;
  }
  return dims;
}

// Whether offset = sum_k c_k * stride_k with |c_k| < size_k, over nested dims[0..k]. Each stride
// exceeds the span below it, so at most two values of c_k leave a remainder the lower dims can reach.
bool reachable(int64_t offset, const std::vector<std::pair<int64_t, int64_t>>& dims, int64_t k) {
  if (k < 0) return offset == 0;
  int64_t below = 0;
  for (int64_t j = 0; j < k; ++j) below += (dims[j].second - 1) * dims[j].first;
  const auto [stride, size] = dims[k];
  const auto floor_div = [](int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); };
  const int64_t lo = std::max(-(size - 1), -floor_div(below - offset, stride));
  const int64_t hi = std::min(size - 1, floor_div(offset + below, stride));
  for (int64_t c = lo; c <= hi; ++c) {
    if (reachable(offset - c * stride, dims, k - 1)) return true;
  }
  return false;
}

// Whether two tensors may share an element. Decided exactly for views of one allocation with the same
// shape, strides and dtype (such as the K and V halves of an interleaved cache); otherwise any
// intersection of the byte spans counts as overlap.
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return false;
  const Span sa = byte_span(a), sb = byte_span(b);
  if (sa.end <= sb.begin || sb.end <= sa.begin) return false;
  if (a.sizes() != b.sizes() || a.strides() != b.strides() || a.element_size() != b.element_size()) return true;
  const int64_t bytes = sb.begin - sa.begin;
  if (bytes % static_cast<int64_t>(a.element_size()) != 0) return true;
  bool nested = false;
  const auto dims = nested_dims(a, &nested);
  return !nested || reachable(bytes / static_cast<int64_t>(a.element_size()), dims, static_cast<int64_t>(dims.size()) - 1);
}

// Outputs must not overlap themselves (two elements in one place), each other, or any input.
void check_no_overlap(const char* op, std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    if (!out->tensor->defined()) continue;  // an optional output not requested
    bool nested = false;
    nested_dims(*out->tensor, &nested);
    TORCH_CHECK(nested, op, ": `", out->name, "` must not have overlapping elements (its strides ",
                out->tensor->strides(), " map several elements of shape ", out->tensor->sizes(),
                " to one place, or cannot be shown not to)");
    for (auto other = std::next(out); other != outputs.end(); ++other) {
      if (!other->tensor->defined()) continue;
      TORCH_CHECK(!may_overlap(*out->tensor, *other->tensor), op, ": `", out->name, "` and `", other->name,
                  "` must be distinct tensors that do not overlap in memory");
    }
    for (const Named& in : inputs) {
      if (!in.tensor->defined()) continue;
      TORCH_CHECK(!may_overlap(*out->tensor, *in.tensor), op, ": output `", out->name, "` must not overlap input `",
                  in.name, "` in memory");
    }
  }
}

void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank, const char* layout) {
  TORCH_CHECK(t.dim() == rank, op, ": `", name, "` must have rank ", rank, " ", layout, ", got shape ", t.sizes());
}

void check_last_dim_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": `", name,
              "` must be contiguous in its last dimension, got strides ", t.strides());
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference,
                       const char* reference_name) {
  TORCH_CHECK(t.device() == reference.device(), op, ": `", name, "` must be on ", reference.device(), " like `",
              reference_name, "`, got ", t.device());
}

// `name` must have the shape, dtype and device of `reference_name`.
void check_like(const char* op, const char* name, const at::Tensor& t, const char* reference_name,
                const at::Tensor& reference) {
  TORCH_CHECK(t.sizes() == reference.sizes(), op, ": `", name, "` must have the shape of `", reference_name, "` ",
              reference.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == reference.scalar_type(), op, ": `", name, "` must have the dtype of `",
              reference_name, "` (", reference.scalar_type(), "), got ", t.scalar_type());
  check_same_device(op, name, t, reference, reference_name);
}

void check_index_tensor(const char* op, const char* name, const at::Tensor& t, c10::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": `", name, "` must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, op, ": `", name, "` must have rank 1, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": `", name, "` must be contiguous");
}

// A log-sum-exp: float32 [num_tokens, num_heads], those of `rows` ([num_tokens, num_heads, head_size]),
// on its device; any strides.
void check_lse(const char* op, const char* name, const at::Tensor& t, const at::Tensor& rows, const char* rows_name) {
  TORCH_CHECK(t.scalar_type() == c10::ScalarType::Float, op, ": `", name, "` must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows.size(0) && t.size(1) == rows.size(1), op, ": `", name,
              "` must have shape [num_tokens, num_heads] = [", rows.size(0), ", ", rows.size(1), "] like `", rows_name,
              "`, got ", t.sizes());
  check_same_device(op, name, t, rows, rows_name);
}

RowsView rows_view(const at::Tensor& t) { return RowsView{t.data_ptr(), t.stride(0), t.stride(1)}; }

// Scales and amax: float32 of shape [1] (per tensor) or [num_kv_heads] (per KV head).
enum class Scalars { kScales, kMaxima };

HeadScalars head_scalars(const char* op, const char* name, const at::Tensor& t, int64_t num_kv_heads,
                         const at::Tensor& device_reference, const char* reference_name, Scalars kind) {
  TORCH_CHECK(t.scalar_type() == c10::ScalarType::Float, op, ": `", name, "` must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && (t.size(0) == 1 || t.size(0) == num_kv_heads), op, ": `", name,
              "` must have shape [1] (per tensor) or [num_kv_heads] = [", num_kv_heads, "] (per KV head), got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": `", name, "` must be contiguous");
  check_same_device(op, name, t, device_reference, reference_name);
  if (kind == Scalars::kScales && t.device().is_cpu()) {
    // Scales on the host are checked here; device scales are the caller's to keep valid (docs/ops.md).
    const float* values = t.data_ptr<float>();
    for (int64_t i = 0; i < t.size(0); ++i) {
      TORCH_CHECK(std::isfinite(values[i]) && values[i] > 0, op, ": `", name, "`[", i, "] = ", values[i],
                  " must be a finite scale > 0");
    }
  }
  return HeadScalars{t.data_ptr<float>(), t.size(0) > 1};
}

// The rotated recipe's arguments (docs/rotated_cache.md): FP8 caches only; `hadamard` needs rotation
// blocks of at least kMinHadamardBlock; `k_offset` is float32 [num_kv_heads, head_size], contiguous,
// on the op's device, and finite where it is on the host (as scales are checked).
CacheTransform cache_transform(const char* op, bool hadamard, const std::optional<at::Tensor>& k_offset,
                               c10::ScalarType cache_type, int64_t num_kv_heads, int64_t head_size,
                               const at::Tensor& device_reference, const char* reference_name) {
  const bool offset = k_offset.has_value();
  TORCH_CHECK(!(hadamard || offset) || is_one_of(kFp8DTypes, cache_type), op, ": `", hadamard ? "hadamard" : "k_offset",
              "` needs an FP8 cache (an unquantized cache stores K/V as they are), got `key_cache` of ", cache_type);
  TORCH_CHECK(!hadamard || hadamard_block(static_cast<int>(head_size)) >= kMinHadamardBlock, op,
              ": `hadamard` needs a head_size divisible by ", kMinHadamardBlock,
              " (the rotation's blocks are the largest power of two dividing it), got ", head_size);
  if (!offset) return CacheTransform{hadamard, nullptr};
  const at::Tensor& t = *k_offset;
  TORCH_CHECK(t.scalar_type() == c10::ScalarType::Float, op, ": `k_offset` must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == num_kv_heads && t.size(1) == head_size, op,
              ": `k_offset` must have shape [num_kv_heads, head_size] = [", num_kv_heads, ", ", head_size, "], got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": `k_offset` must be contiguous");
  check_same_device(op, "k_offset", t, device_reference, reference_name);
  if (t.device().is_cpu()) {
    const float* values = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      TORCH_CHECK(std::isfinite(values[i]), op, ": `k_offset`[", i / head_size, ", ", i % head_size, "] = ", values[i],
                  " must be finite");
    }
  }
  return CacheTransform{hadamard, t.data_ptr<float>()};
}

// Checks a [num_blocks, block_size, num_kv_heads, head_size] cache and describes it.
CacheView cache_view(const char* op, const char* name, const at::Tensor& cache) {
  check_rank(op, name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]");
  check_last_dim_contiguous(op, name, cache);
  TORCH_CHECK(cache.size(0) > 0 && cache.size(1) > 0 && cache.size(2) > 0 && cache.size(3) > 0, op, ": `", name,
              "` must have non-empty dimensions, got shape ", cache.sizes());
  for (int64_t d = 0; d < 4; ++d) check_int32(op, name, "dimension", cache.size(d));
  return CacheView{cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2)};
}

// The key and value caches of one layer: alike, on `source`'s device, FP8 or `source`'s dtype. Returns their dtype.
c10::ScalarType check_cache_pair(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const char* source_name, const at::Tensor& source) {
  check_like(op, "value_cache", value_cache, "key_cache", key_cache);
  check_same_device(op, "key_cache", key_cache, source, source_name);
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(is_one_of(kFp8DTypes, cache_type) || cache_type == source.scalar_type(), op, ": `key_cache` must be ",
              format_list(kFp8DTypes), " or the dtype of `", source_name, "` (", source.scalar_type(), "), got ",
              cache_type);
  return cache_type;
}

// key and value: [num_tokens, num_kv_heads, head_size], same shape, dtype and device.
void check_key_value(const char* op, const at::Tensor& key, const at::Tensor& value) {
  check_rank(op, "key", key, 3, "[num_tokens, num_kv_heads, head_size]");
  const auto t = key.scalar_type();
  TORCH_CHECK(is_one_of(kSourceDTypes, t), op, ": `key` must be ", format_list(kSourceDTypes, " or "), ", got ", t);
  check_last_dim_contiguous(op, "key", key);
  TORCH_CHECK(key.size(1) > 0 && key.size(2) > 0, op, ": `key` must have num_kv_heads >= 1 and head_size >= 1, got ",
              "shape ", key.sizes());
  check_int32(op, "key", "num_kv_heads", key.size(1));
  check_int32(op, "key", "head_size", key.size(2));
  check_like(op, "value", value, "key", key);
  check_last_dim_contiguous(op, "value", value);
}

KeyValueInput key_value_input(const at::Tensor& key, const at::Tensor& value) {
  return KeyValueInput{key.data_ptr(), value.data_ptr(), to_dtype(key.scalar_type()), key.stride(0), key.stride(1),
                       value.stride(0), value.stride(1)};
}

}  // namespace

CacheWriteParams cache_write_params(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                    const at::Tensor& k_scale, const at::Tensor& v_scale, bool hadamard,
                                    const std::optional<at::Tensor>& k_offset) {
  constexpr const char* op = "fp8kv.reshape_and_cache";
  check_key_value(op, key, value);
  CacheWriteParams p{};
  p.key_cache = cache_view(op, "key_cache", key_cache);
  p.value_cache = cache_view(op, "value_cache", value_cache);
  const auto cache_type = check_cache_pair(op, key_cache, value_cache, "key", key);
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2), op,
              ": `key_cache` [num_blocks, block_size, num_kv_heads, head_size] must match `key` [num_tokens, ",
              "num_kv_heads, head_size] in num_kv_heads and head_size, got ", key_cache.sizes(), " and ", key.sizes());
  check_index_tensor(op, "slot_mapping", slot_mapping, c10::ScalarType::Long);
  TORCH_CHECK(slot_mapping.size(0) <= key.size(0), op, ": `slot_mapping` has ", slot_mapping.size(0),
              " entries but `key` has only ", key.size(0), " tokens");
  check_same_device(op, "slot_mapping", slot_mapping, key, "key");
  check_no_overlap(op, {{"key_cache", &key_cache}, {"value_cache", &value_cache}},
                   {{"key", &key}, {"value", &value}, {"slot_mapping", &slot_mapping}, {"k_scale", &k_scale},
                    {"v_scale", &v_scale}, {"k_offset", k_offset.has_value() ? &*k_offset : &kNoTensor}});

  static_cast<KeyValueInput&>(p) = key_value_input(key, value);
  p.cache_dtype = to_dtype(cache_type);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_slots = slot_mapping.size(0);
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(key.size(2));
  p.block_size = static_cast<int>(key_cache.size(1));
  p.num_blocks = static_cast<int>(key_cache.size(0));
  p.k_scale = head_scalars(op, "k_scale", k_scale, p.num_kv_heads, key, "key", Scalars::kScales);
  p.v_scale = head_scalars(op, "v_scale", v_scale, p.num_kv_heads, key, "key", Scalars::kScales);
  p.transform = cache_transform(op, hadamard, k_offset, cache_type, p.num_kv_heads, p.head_size, key, "key");
  return p;
}

namespace {

// How a call names the query's sizes in its errors: the operand (`query`) or the plan's arguments.
struct QuerySizeNames {
  const char* heads;  // "`query` num_heads" or "`num_heads`"
  const char* rows;   // "`query`" or "`num_query_tokens`"
};

// The sizes a paged-attention call is planned from (the cache's geometry and dtype, the block table's
// shape, decode or multi-token, the query rows and heads, the window, fp8_math), checked and set in p;
// `reference` is the tensor whose device the index tensors must be on.
void check_attention_sizes(const char* op, PagedAttentionParams& p, const at::Tensor& key_cache,
                           c10::ScalarType cache_type, const at::Tensor& block_tables,
                           const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_query_tokens, int64_t num_heads,
                           int64_t sliding_window, bool fp8_math, const char* reference_name,
                           const at::Tensor& reference, const QuerySizeNames& names) {
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, op, ": ", names.heads, " (", num_heads,
              ") must be a multiple of the cache's num_kv_heads (", num_kv_heads, ")");
  check_rank(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]");
  TORCH_CHECK(block_tables.scalar_type() == c10::ScalarType::Int, op, ": `block_tables` must be int32, got ",
              block_tables.scalar_type());
  check_last_dim_contiguous(op, "block_tables", block_tables);
  check_same_device(op, "block_tables", block_tables, reference, reference_name);
  const int64_t num_seqs = block_tables.size(0);
  check_int32(op, "block_tables", "num_seqs", num_seqs);
  TORCH_CHECK(block_tables.size(1) <= kMaxTokensPerSequence / key_cache.size(1), op,
              ": `block_tables` rows cover max_blocks_per_seq * block_size = ", block_tables.size(1), " * ",
              key_cache.size(1), " tokens; at most ", kMaxTokensPerSequence, " tokens per sequence are supported");
  if (cu_seqlens_q.has_value()) {
    check_index_tensor(op, "cu_seqlens_q", *cu_seqlens_q, c10::ScalarType::Int);
    TORCH_CHECK(cu_seqlens_q->size(0) == num_seqs + 1, op, ": `cu_seqlens_q` must have num_seqs + 1 = ",
                num_seqs + 1, " entries, got ", cu_seqlens_q->size(0));
    check_same_device(op, "cu_seqlens_q", *cu_seqlens_q, reference, reference_name);
  } else {
    TORCH_CHECK(num_query_tokens == num_seqs, op, ": without `cu_seqlens_q` (decode) ", names.rows,
                " must have one row per sequence: ", num_seqs, " rows, got ", num_query_tokens);
  }
  TORCH_CHECK(sliding_window == -1 || (sliding_window > 0 && sliding_window <= kMaxInt32), op,
              ": `sliding_window` must be -1 (none) or a positive number of tokens up to ", kMaxInt32, ", got ",
              sliding_window);
  TORCH_CHECK(!fp8_math || is_one_of(kCudaFp8MathDTypes, cache_type), op, ": `fp8_math` needs a ",
              format_list(kCudaFp8MathDTypes, " or "), " cache, got `key_cache` ", cache_type);

  p.cache_dtype = to_dtype(cache_type);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  p.cu_seqlens_q = cu_seqlens_q.has_value() ? cu_seqlens_q->data_ptr<int32_t>() : nullptr;
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_query_tokens = num_query_tokens;
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_size = static_cast<int>(key_cache.size(3));
  p.block_size = static_cast<int>(key_cache.size(1));
  p.num_blocks = static_cast<int>(key_cache.size(0));
  p.sliding_window = static_cast<int>(sliding_window);
  p.fp8_math = fp8_math;
}

}  // namespace

PagedAttentionOperands paged_attention_params(const at::Tensor& out, const at::Tensor& query,
                                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                              const std::optional<at::Tensor>& cu_seqlens_q, double softmax_scale,
                                              const at::Tensor& k_scale, const at::Tensor& v_scale,
                                              int64_t sliding_window, double logits_soft_cap, bool hadamard,
                                              const std::optional<at::Tensor>& k_offset, bool fp8_math,
                                              const std::optional<at::Tensor>& lse) {
  constexpr const char* op = "fp8kv.paged_attention";
  check_rank(op, "query", query, 3, "[num_query_tokens, num_heads, head_size]");
  const auto query_type = query.scalar_type();
  TORCH_CHECK(is_one_of(kQueryDTypes, query_type), op, ": `query` must be ", format_list(kQueryDTypes, " or "),
              ", got ", query_type);
  check_last_dim_contiguous(op, "query", query);
  TORCH_CHECK(query.size(1) > 0 && query.size(2) > 0, op, ": `query` must have num_heads >= 1 and head_size >= 1, ",
              "got shape ", query.sizes());
  TORCH_CHECK(query.size(0) <= kMaxInt32 / query.size(1), op, ": `query` has num_query_tokens * num_heads = ",
              query.size(0), " * ", query.size(1), " rows, beyond the int32 limit ", kMaxInt32);
  check_like(op, "out", out, "query", query);
  check_last_dim_contiguous(op, "out", out);

  PagedAttentionParams p{};
  p.key_cache = cache_view(op, "key_cache", key_cache);
  p.value_cache = cache_view(op, "value_cache", value_cache);
  const auto cache_type = check_cache_pair(op, key_cache, value_cache, "query", query);
  TORCH_CHECK(key_cache.size(3) == query.size(2), op, ": `key_cache` head_size (dim 3) must equal `query` head_size ",
              query.size(2), ", got ", key_cache.sizes());
  check_attention_sizes(op, p, key_cache, cache_type, block_tables, cu_seqlens_q, query.size(0), query.size(1),
                        sliding_window, fp8_math, "query", query, {"`query` num_heads", "`query`"});
  check_index_tensor(op, "seq_lens", seq_lens, c10::ScalarType::Int);
  TORCH_CHECK(seq_lens.size(0) == p.num_seqs, op, ": `seq_lens` must have num_seqs = ", p.num_seqs,
              " entries (rows of `block_tables`), got ", seq_lens.size(0));
  check_same_device(op, "seq_lens", seq_lens, query, "query");
  const float scale32 = positive_float32(op, "softmax_scale", softmax_scale, "");
  const float cap32 = logits_soft_cap == 0 ? 0.0f : positive_float32(op, "logits_soft_cap", logits_soft_cap, "0 (none) or ");
  if (lse.has_value()) check_lse(op, "lse", *lse, query, "query");
  check_no_overlap(op, {{"out", &out}, {"lse", lse.has_value() ? &*lse : &kNoTensor}},
                   {{"query", &query}, {"key_cache", &key_cache}, {"value_cache", &value_cache},
                    {"block_tables", &block_tables}, {"seq_lens", &seq_lens},
                    {"cu_seqlens_q", cu_seqlens_q.has_value() ? &*cu_seqlens_q : &kNoTensor},
                    {"k_scale", &k_scale}, {"v_scale", &v_scale},
                    {"k_offset", k_offset.has_value() ? &*k_offset : &kNoTensor}});
  TORCH_CHECK(!may_overlap(key_cache, value_cache), op,
              ": `key_cache` and `value_cache` must be distinct tensors that do not overlap in memory");

  p.out = out.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.query = query.data_ptr();
  p.query_token_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.query_dtype = to_dtype(query_type);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.softmax_scale = scale32;
  p.k_scale = head_scalars(op, "k_scale", k_scale, p.num_kv_heads, query, "query", Scalars::kScales);
  p.v_scale = head_scalars(op, "v_scale", v_scale, p.num_kv_heads, query, "query", Scalars::kScales);
  p.logits_soft_cap = cap32;
  p.transform = cache_transform(op, hadamard, k_offset, cache_type, p.num_kv_heads, p.head_size, query, "query");
  return PagedAttentionOperands{p, lse.has_value() ? rows_view(*lse) : RowsView{}};
}

PagedAttentionParams plan_params(const at::Tensor& key_cache, const at::Tensor& block_tables,
                                 const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_query_tokens,
                                 int64_t num_heads, int64_t sliding_window, bool fp8_math) {
  constexpr const char* op = "fp8kv.plan_paged_attention";
  TORCH_CHECK(num_heads > 0, op, ": `num_heads` must be >= 1, got ", num_heads);
  TORCH_CHECK(num_query_tokens >= 0 && num_query_tokens <= kMaxInt32 / num_heads, op,
              ": `num_query_tokens` must be >= 0 with num_query_tokens * num_heads within the int32 limit ", kMaxInt32,
              ", got ", num_query_tokens, " * ", num_heads);
  PagedAttentionParams p{};
  p.key_cache = cache_view(op, "key_cache", key_cache);
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(is_one_of(kFp8DTypes, cache_type) || is_one_of(kQueryDTypes, cache_type), op, ": `key_cache` must be ",
              format_list(kFp8DTypes), " or a query dtype (", format_list(kQueryDTypes, " or "), "), got ", cache_type);
  check_attention_sizes(op, p, key_cache, cache_type, block_tables, cu_seqlens_q, num_query_tokens, num_heads,
                        sliding_window, fp8_math, "key_cache", key_cache, {"`num_heads`", "`num_query_tokens`"});
  return p;
}

void check_plan(const char* op, c10::IntArrayRef plan, const std::vector<int64_t>& expected) {
  TORCH_CHECK(std::equal(plan.begin(), plan.end(), expected.begin(), expected.end()), op, ": `plan` ", plan,
              " is not this call's plan ", c10::IntArrayRef(expected),
              ": it was made for other sizes, another device, `lse`, `fp8_math` or `sliding_window` (plan each step's "
              "calls with fp8kv.plan_paged_attention for their sizes)");
}

void* checked_workspace(const char* op, const at::Tensor& workspace, int64_t bytes, const at::Tensor& reference) {
  check_same_device(op, "workspace", workspace, reference, "query");
  TORCH_CHECK(workspace.is_contiguous() && workspace.numel() * static_cast<int64_t>(workspace.element_size()) >= bytes,
              op, ": `workspace` must be a contiguous tensor of at least the plan's ", bytes, " bytes, got ",
              workspace.numel() * static_cast<int64_t>(workspace.element_size()), " bytes",
              workspace.is_contiguous() ? "" : " (not contiguous)");
  return workspace.data_ptr();
}

MergeStatesParams merge_states_params(const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                      const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                      const at::Tensor& lse_b) {
  constexpr const char* op = "fp8kv.merge_attention_states";
  check_rank(op, "out_a", out_a, 3, "[num_tokens, num_heads, head_size]");
  const auto dtype = out_a.scalar_type();
  TORCH_CHECK(is_one_of(kSourceDTypes, dtype), op, ": `out_a` must be ", format_list(kSourceDTypes, " or "), ", got ",
              dtype);
  TORCH_CHECK(out_a.size(1) > 0 && out_a.size(2) > 0, op, ": `out_a` must have num_heads >= 1 and head_size >= 1, ",
              "got shape ", out_a.sizes());
  TORCH_CHECK(out_a.size(0) <= kMaxInt32 / out_a.size(1), op, ": `out_a` has num_tokens * num_heads = ", out_a.size(0),
              " * ", out_a.size(1), " rows, beyond the int32 limit ", kMaxInt32);
  check_int32(op, "out_a", "head_size", out_a.size(2));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"out_b", &out_b}, {"out", &out}}) {
    check_like(op, name, *t, "out_a", out_a);
  }
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"out_a", &out_a}, {"out_b", &out_b}, {"out", &out}}) {
    check_last_dim_contiguous(op, name, *t);
  }
  check_lse(op, "lse_a", lse_a, out_a, "out_a");
  check_lse(op, "lse_b", lse_b, out_a, "out_a");
  if (lse.has_value()) check_lse(op, "lse", *lse, out_a, "out_a");
  check_no_overlap(op, {{"out", &out}, {"lse", lse.has_value() ? &*lse : &kNoTensor}},
                   {{"out_a", &out_a}, {"lse_a", &lse_a}, {"out_b", &out_b}, {"lse_b", &lse_b}});
  MergeStatesParams p{};
  p.out = rows_view(out);
  p.lse = lse.has_value() ? rows_view(*lse) : RowsView{};
  p.out_a = rows_view(out_a);
  p.lse_a = rows_view(lse_a);
  p.out_b = rows_view(out_b);
  p.lse_b = rows_view(lse_b);
  p.dtype = to_dtype(dtype);
  p.num_tokens = out_a.size(0);
  p.num_heads = static_cast<int>(out_a.size(1));
  p.head_size = static_cast<int>(out_a.size(2));
  return p;
}

AmaxParams amax_params(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_amax,
                       const at::Tensor& v_amax) {
  constexpr const char* op = "fp8kv.kv_amax";
  check_key_value(op, key, value);
  AmaxParams p{};
  static_cast<KeyValueInput&>(p) = key_value_input(key, value);
  p.num_tokens = key.size(0);
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(key.size(2));
  p.k_amax = head_scalars(op, "k_amax", k_amax, p.num_kv_heads, key, "key", Scalars::kMaxima);
  p.v_amax = head_scalars(op, "v_amax", v_amax, p.num_kv_heads, key, "key", Scalars::kMaxima);
  check_no_overlap(op, {{"k_amax", &k_amax}, {"v_amax", &v_amax}}, {{"key", &key}, {"value", &value}});
  return p;
}

}  // namespace fp8kv
