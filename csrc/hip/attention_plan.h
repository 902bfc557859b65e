// The HIP backend's AttentionPlan (the launcher contract of csrc/gpu/kernels.h): its kernel finds rows
// and split ranges on the device, so the host plans only the split count.
#pragma once

#include <cstdint>

namespace fp8kv::hip {

struct AttentionPlan {
  int64_t workspace_bytes;  // the splits' partial results (0 with one split)
  int request;              // the kernel the caller forced: always 0 (the backend's one kernel)
  int num_splits;           // context splits per row; 1 writes `out` directly
};

}  // namespace fp8kv::hip
