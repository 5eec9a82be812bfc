#include "engine/codec/preview.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/dtype_dispatch.h"
#include "hemiola/status.h"

namespace hemiola {

int preview_levels(int world) { return world >= 1 ? 127 / world : 0; }

double preview_range(int world) { return 5.0 * std::sqrt(static_cast<double>(world)); }

void preview_scales(DType dtype, const void* averaged, size_t n, int world, float* scales) {
  const int levels = preview_levels(world);
  const double range = preview_range(world);
  for_floating(dtype, [&](auto access) {
    using A = decltype(access);
    for (size_t first = 0, block = 0; first < n; first += kPreviewBlock, ++block) {
      const size_t last = std::min(n, first + kPreviewBlock);
      double sum = 0.0;
      for (size_t i = first; i < last; ++i) {
        const double x = static_cast<double>(A::at(averaged, i));
        sum += x * x;
      }
      const double rms = std::sqrt(sum / static_cast<double>(last - first));
      const bool usable = levels > 0 && std::isfinite(rms) && rms > 0.0;
      scales[block] = usable ? static_cast<float>(range * rms / levels) : 0.0f;
    }
  }, "no preview of dtype ", dtype);
}

void preview_encode(DType dtype, const void* grad, size_t offset, size_t n, const float* scales,
                    int levels, int8_t* codes, void* estimate) {
  for_floating(dtype, [&](auto access) {
    using A = decltype(access);
    using V = typename A::Compute;
    const V limit = static_cast<V>(levels);
    // Adding and subtracting 1.5 * 2^mantissa rounds a value this small to
    // the nearest integer, ties to even, as rint does, without a libm call
    // per element (this runs on the preview lane for every element, every
    // iteration).
    const V magic = static_cast<V>(std::is_same_v<V, double> ? 6755399441055744.0 : 12582912.0);
    for (size_t i = 0; i < n;) {
      // One block (or the part of it in this tensor) at a time.
      const size_t block = (offset + i) / kPreviewBlock;
      const size_t end = std::min(n, (block + 1) * kPreviewBlock - offset);
      const V s = static_cast<V>(scales[block]);
      const V inverse = s > V(0) ? V(1) / s : V(0);
      for (; i < end; ++i) {
        const V g = A::at(grad, i);
        const V clamped = std::min(limit, std::max(-limit, g * inverse));
        // A non-finite g is coded 0 and kept in the estimate (it is this rank's own).
        const V q = g - g == V(0) ? (clamped + magic) - magic : V(0);
        codes[i] = static_cast<int8_t>(q);
        A::put(estimate, i, g - s * q);
      }
    }
  }, "no preview of dtype ", dtype);
}

void preview_decode(DType dtype, const int8_t* sums, size_t offset, size_t n,
                    const float* scales, int world, void* estimate) {
  for_floating(dtype, [&](auto access) {
    using A = decltype(access);
    using V = typename A::Compute;
    for (size_t i = 0; i < n;) {
      const size_t block = (offset + i) / kPreviewBlock;
      const size_t end = std::min(n, (block + 1) * kPreviewBlock - offset);
      const V step = static_cast<V>(scales[block]) / static_cast<V>(world);
      for (; i < end; ++i) {
        A::put(estimate, i, A::at(estimate, i) + step * static_cast<V>(sums[i]));
      }
    }
  }, "no preview of dtype ", dtype);
}

void preview_distance(DType dtype, const void* estimate, const void* averaged, size_t n,
                      double* distance, double* norm) {
  for_floating(dtype, [&](auto access) {
    using A = decltype(access);
    double d = 0.0;
    double r = 0.0;
    for (size_t i = 0; i < n; ++i) {
      const double a = static_cast<double>(A::at(averaged, i));
      const double e = static_cast<double>(A::at(estimate, i)) - a;
      d += e * e;
      r += a * a;
    }
    *distance += d;
    *norm += r;
  }, "no preview of dtype ", dtype);
}

}  // namespace hemiola
