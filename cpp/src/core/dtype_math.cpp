#include "core/dtype_math.h"

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

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void scale_half(void* data, size_t n, float factor) {
  uint16_t* d = static_cast<uint16_t*>(data);
  for (size_t i = 0; i < n; ++i) d[i] = FromFloat(ToFloat(d[i]) * factor);
}
}  // namespace

void sum_into(DType dtype, void* out, const void* a, const void* b, size_t n) {
  switch (dtype) {
    case DType::kFloat32: return sum_native<float>(out, a, b, n);
    case DType::kFloat64: return sum_native<double>(out, a, b, n);
    case DType::kFloat16:
    case DType::kBFloat16:
      return sum_halves(dtype, static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                        static_cast<const uint16_t*>(b), n);
    case DType::kInt32: return sum_native<int32_t>(out, a, b, n);
    case DType::kInt64: return sum_native<int64_t>(out, a, b, n);
    case DType::kUInt8: return sum_native<uint8_t>(out, a, b, n);
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "cannot sum dtype ", dtype_name(dtype));
}

void scale_in_place(DType dtype, void* data, size_t n, double factor) {
  switch (dtype) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(data);
      const float f = static_cast<float>(factor);
      for (size_t i = 0; i < n; ++i) d[i] *= f;
      return;
    }
    case DType::kFloat64: {
      double* d = static_cast<double*>(data);
      for (size_t i = 0; i < n; ++i) d[i] *= factor;
      return;
    }
    case DType::kFloat16:
      return scale_half<fp16_to_float, float_to_fp16>(data, n, static_cast<float>(factor));
    case DType::kBFloat16:
      return scale_half<bf16_to_float, float_to_bf16>(data, n, static_cast<float>(factor));
    default:
      break;
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "cannot scale (average) dtype ", dtype_name(dtype),
                ": only floating dtypes can be averaged");
}

}  // namespace hemiola
