// The median of the engine's micro-benchmarks' timings.
#pragma once

#include <algorithm>
#include <vector>

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
