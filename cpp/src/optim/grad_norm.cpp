#include "optim/grad_norm.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/dtype_dispatch.h"
#include "hemiola/status.h"

namespace hemiola::optim {

namespace {

// Calls f(value as double) for every element.
template <typename F>
void for_each(const void* data, std::int64_t n, DType dtype, F&& f) {
  for_floating(
      dtype,
      [&](auto e) {
        using E = decltype(e);
        const auto* x = static_cast<const typename E::Storage*>(data);
        for (std::int64_t i = 0; i < n; ++i) f(static_cast<double>(E::load(x[i])));
      },
      "gradient norm: dtype ", dtype, " is not a floating dtype");
}

}  // namespace

void accumulate_norm(const void* data, std::int64_t numel, DType dtype, double p, double& acc) {
  HEMIOLA_CHECK(p > 0.0, "gradient norm: norm_type must be positive or inf, got ", p);
  if (std::isinf(p)) {
    for_each(data, numel, dtype, [&](double x) {
      const double a = std::fabs(x);
      if (std::isnan(a) || a > acc) acc = a;  // NaN sticks (NaN > acc is false)
    });
  } else if (p == 2.0) {
    double sum = 0.0;
    for_each(data, numel, dtype, [&](double x) { sum += x * x; });
    acc += sum;
  } else if (p == 1.0) {
    double sum = 0.0;
    for_each(data, numel, dtype, [&](double x) { sum += std::fabs(x); });
    acc += sum;
  } else {
    double sum = 0.0;
    for_each(data, numel, dtype, [&](double x) { sum += std::pow(std::fabs(x), p); });
    acc += sum;
  }
}

double finish_norm(double acc, double p) {
  if (std::isinf(p) || p == 1.0) return acc;
  if (p == 2.0) return std::sqrt(acc);
  return std::pow(acc, 1.0 / p);
}

double round_to(DType dtype, double x) {
  // A norm of a non-floating tensor is float32's, as torch computes it.
  if (!is_floating(dtype)) return static_cast<float>(x);
  return for_floating(
      dtype,
      [x](auto e) -> double {
        using E = decltype(e);
        return E::round(static_cast<typename E::Compute>(x));
      },
      "gradient norm: dtype ", dtype, " is not a floating dtype");
}

bool all_finite(const void* data, std::int64_t numel, DType dtype) {
  bool finite = true;
  for_each(data, numel, dtype, [&](double x) { finite = finite && std::isfinite(x); });
  return finite;
}

}  // namespace hemiola::optim
