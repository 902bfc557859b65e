// The op schemas: the one place where fp8kv's operators are declared. Backends register kernels
// for them with TORCH_LIBRARY_IMPL; fake (meta) kernels live in python/fp8kv/_ops.py.
#include <torch/library.h>

TORCH_LIBRARY(fp8kv, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, bool hadamard=False, Tensor? k_offset=None) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor? cu_seqlens_q, float softmax_scale, "
      "Tensor k_scale, Tensor v_scale, int sliding_window=-1, float logits_soft_cap=0.0, bool hadamard=False, "
      "Tensor? k_offset=None, bool fp8_math=False, Tensor(b!)? lse=None, int[]? plan=None, "
      "Tensor(c!)? workspace=None) -> ()");
  // How paged_attention runs calls of these sizes (kernel, splits, workspace bytes), from sizes only:
  // made once per step and given to every layer's call with a workspace of its size.
  m.def(
      "plan_paged_attention(Tensor key_cache, Tensor block_tables, Tensor? cu_seqlens_q, int num_query_tokens, "
      "int num_heads, int sliding_window=-1, bool fp8_math=False, bool lse=False, str kernel=\"auto\") -> int[]");
  m.def(
      "merge_attention_states(Tensor(a!) out, Tensor(b!)? lse, Tensor out_a, Tensor lse_a, Tensor out_b, "
      "Tensor lse_b) -> ()");
  m.def("kv_amax(Tensor key, Tensor value, Tensor(a!) k_amax, Tensor(b!) v_amax) -> ()");
  // Index checks on request: they read index tensors on the host (a device tensor is copied, which
  // synchronizes), the checks the CPU kernels always run and device kernels run only with
  // FP8KV_DEBUG_CHECKS=1.
  m.def("check_cache_write_indices(Tensor slot_mapping, Tensor key_cache) -> ()");
  m.def(
      "check_paged_attention_indices(Tensor block_tables, Tensor seq_lens, Tensor? cu_seqlens_q, "
      "int num_query_tokens, Tensor key_cache, int sliding_window=-1) -> ()");
  // The kernels' supported-value lists by name (supported_values.cpp); no tensors.
  m.def("supported_values(str name) -> int[]");
}
