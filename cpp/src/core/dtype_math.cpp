#include "core/dtype_math.h"

#include "core/dtype_dispatch.h"
#include "core/half_cast.h"

#include "hemiola/status.h"

namespace hemiola {

namespace {
template <typename T>
void sum_native(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}
}  // namespace

void sum_into(DType dtype, void* out, const void* a, const void* b, size_t n) {
  switch (dtype) {
    case DType::kInt32: return sum_native<int32_t>(out, a, b, n);
    case DType::kInt64: return sum_native<int64_t>(out, a, b, n);
    case DType::kUInt8: return sum_native<uint8_t>(out, a, b, n);
    default: break;
  }
  for_floating(
      dtype,
      [&](auto e) {
        using E = decltype(e);
        if constexpr (E::kHalf) {
          // The bulk path (half_cast.h): the same bits as E::store(E::load(a) + E::load(b)).
          sum_halves(E::dtype, static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                     static_cast<const uint16_t*>(b), n);
        } else {
          sum_native<typename E::Storage>(out, a, b, n);
        }
      },
      "cannot sum dtype ", dtype);
}

void scale_in_place(DType dtype, void* data, size_t n, double factor) {
  for_floating(
      dtype,
      [&](auto e) {
        using E = decltype(e);
        // The factor is taken in the compute type once (float for the half
        // types and float32), each product rounded to the dtype once.
        auto* d = static_cast<typename E::Storage*>(data);
        const auto f = static_cast<typename E::Compute>(factor);
        for (size_t i = 0; i < n; ++i) d[i] = E::store(E::load(d[i]) * f);
      },
      "cannot scale (average) dtype ", dtype, ": only floating dtypes can be averaged");
}

}  // namespace hemiola
