// Host check of fp8_unpack.h, run by scripts/check_hip_sources.sh: for every format, every code at
// every byte position of a word (next to every other code), unpack4(word) * kScale must equal the
// shared codec's fp8_decode bit for bit (NaN for NaN). Not part of the library.
#include <cstdio>

#include "fp8_unpack.h"

namespace {

template <fp8kv::Fp8Format F>
int count_mismatches(const char* name) {
  using Unpack = fp8kv::hip::Fp8Unpack<F>;
  int mismatches = 0;
  for (uint32_t a = 0; a < 256; ++a) {
    for (uint32_t b = 0; b < 256; ++b) {
      // (a, b) in the low half and, swapped with a scrambled pair, in the high half.
      const uint32_t other = ((a * 7u + 13u) & 0xFFu) | (((b * 11u + 5u) & 0xFFu) << 8);
      const uint32_t words[2] = {a | (b << 8) | (other << 16), other | (a << 16) | (b << 24)};
      for (uint32_t word : words) {
        float unpacked[4];
        Unpack::unpack4(word, unpacked);
        for (int i = 0; i < 4; ++i) {
          const uint8_t code = static_cast<uint8_t>(word >> (8 * i));
          const float expected = fp8kv::fp8_decode<F>(code);
          const float got = unpacked[i] * Unpack::kScale;  // a power of two: exact
          const bool same = (expected != expected) ? (got != got) : fp8kv::float_bits(got) == fp8kv::float_bits(expected);
          if (!same && ++mismatches <= 5) {
            std::printf("%s: word 0x%08x byte %d (code 0x%02x): expected %a, got %a\n", name, word, i, code, expected,
                        got);
          }
        }
      }
    }
  }
  return mismatches;
}

}  // namespace

int main() {
  const int mismatches = count_mismatches<fp8kv::Fp8Format::kE4M3FN>("e4m3fn") +
                         count_mismatches<fp8kv::Fp8Format::kE4M3FNUZ>("e4m3fnuz") +
                         count_mismatches<fp8kv::Fp8Format::kE5M2>("e5m2");
  if (mismatches != 0) {
    std::printf("fp8_unpack: %d mismatches against fp8_decode\n", mismatches);
    return 1;
  }
  std::printf("fp8_unpack: all codes of e4m3fn, e4m3fnuz, e5m2 at all byte positions match fp8_decode\n");
  return 0;
}
