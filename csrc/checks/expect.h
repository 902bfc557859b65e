// The host checks' tally (csrc/checks/*.cpp): each expectation counts, the first 20 failures print,
// and `finish` reports and gives the exit status.
#pragma once

#include <cstdio>
#include <string>

namespace fp8kv::checks {

inline int failures = 0;
inline int count = 0;

inline void expect(bool ok, const std::string& what) {
  ++count;
  if (!ok && ++failures <= 20) std::printf("FAILED %s\n", what.c_str());
}

inline int finish(const char* name) {
  std::printf("%s: %d checks, %d failed\n", name, count, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace fp8kv::checks
