// Built and loaded by cmake/toolchain.cmake at configure time: an op that raises an error whose
// message is formatted through the C++ streams, as every argument check of fp8kv does. The toolchain
// is accepted only if the error reaches Python as a RuntimeError with exactly this text.
#include <torch/library.h>

#include <cstdint>

namespace {

void raise_formatted(int64_t n) {
  TORCH_CHECK(false, "probe: ", n, " != ", n + 1, " (", 0.5, ")");
}

}  // namespace

TORCH_LIBRARY(fp8kv_toolchain_probe, m) {
  m.def("raise_formatted(int n) -> ()", &raise_formatted);
}
