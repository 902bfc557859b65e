// The kernels' supported-value lists (dispatch.h) by name, for Python (fp8kv._ops.supported_values):
// tests and scripts read them from the library rather than restating them.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <torch/library.h>

#include "dispatch.h"

namespace fp8kv {
namespace {

template <std::size_t N>
std::vector<int64_t> as_list(const int (&values)[N]) {
  return std::vector<int64_t>(std::begin(values), std::end(values));
}

std::vector<int64_t> supported_values(c10::string_view name) {
  const std::pair<const char*, std::vector<int64_t>> lists[] = {
      {"cuda_head_sizes", as_list(kCudaHeadSizes)},
      {"cuda_block_sizes", as_list(kCudaBlockSizes)},
      {"cuda_sm90a_head_sizes", as_list(kCudaSm90aHeadSizes)},
      {"cuda_sm90a_fp8_math_head_sizes", as_list(kCudaSm90aFp8MathHeadSizes)},
      {"cuda_sm90a_capability", as_list(kCudaSm90aCapability)},
      {"cuda_decode_table_seqs", as_list(kCudaDecodeTableSeqs)},
  };
  std::string known;
  for (const auto& [list_name, values] : lists) {
    if (name == list_name) return values;
    known += (known.empty() ? "" : ", ") + std::string(list_name);
  }
  TORCH_CHECK(false, "fp8kv.supported_values: `name` must be one of ", known, ", got \"", name, "\"");
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8kv, CompositeExplicitAutograd, m) { m.impl("supported_values", &supported_values); }

}  // namespace fp8kv
