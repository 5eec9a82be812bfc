// A small deterministic random generator (SplitMix64). The standard library's
// distributions are implementation-defined, so we derive integers and doubles
// ourselves: the same seed gives the same workload on every platform.
#pragma once

#include <cstdint>

namespace hemiola::cluster {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next_u64() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [lo, hi] (inclusive); the modulo bias is < 2^-40 for our ranges.
  long long uniform_int(long long lo, long long hi) {
    const auto span = static_cast<std::uint64_t>(hi - lo) + 1;
    return lo + static_cast<long long>(next_u64() % span);
  }

 private:
  std::uint64_t state_;
};

}  // namespace hemiola::cluster
