// The compressed wire's cast kernels (cast_kernels.h): element-wise, one
// grid-stride loop each.
#include <cstdint>

#include "cuda/kernel_support.cuh"
#include "engine/codec/cast_kernels.h"
#include "hemiola/status.h"

namespace hemiola::cuda {

namespace {

template <typename From, typename To>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const From* __restrict__ src, To* __restrict__ dst, std::int64_t numel) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < numel; i += stride) {
    dst[i] = Elem<To>::from_math(Elem<From>::to_math(src[i]));
  }
}

template <typename From, typename To>
void launch_cast(const void* src, void* dst, std::int64_t numel, void* stream) {
  cast_kernel<From, To><<<elementwise_blocks(numel), kThreads, 0, as_stream(stream)>>>(
      static_cast<const From*>(src), static_cast<To*>(dst), numel);
  HEMIOLA_CHECK_LAUNCH("cast");
}

template <typename Half>
__global__ void __launch_bounds__(kThreads)
    cast_divide_kernel(const float* __restrict__ src, Half* __restrict__ dst, std::int64_t numel,
                       float divisor) {
  const std::int64_t stride = static_cast<std::int64_t>(blockDim.x) * gridDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < numel; i += stride) {
    const float rounded = Elem<Half>::to_math(Elem<Half>::from_math(src[i]));
    dst[i] = Elem<Half>::from_math(rounded / divisor);
  }
}

template <typename Half>
void launch_cast_divide(const float* src, void* dst, std::int64_t numel, float divisor,
                        void* stream) {
  cast_divide_kernel<Half><<<elementwise_blocks(numel), kThreads, 0, as_stream(stream)>>>(
      src, static_cast<Half*>(dst), numel, divisor);
  HEMIOLA_CHECK_LAUNCH("cast_divide");
}

}  // namespace

void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t numel,
          void* stream) {
  HEMIOLA_CHECK(numel >= 0, "cast: negative element count ", numel);
  HEMIOLA_CHECK(numel == 0 || (src && dst), "cast: null pointer");
  const bool narrowing = src_dtype == DType::kFloat32 &&
                         (dst_dtype == DType::kFloat16 || dst_dtype == DType::kBFloat16);
  const bool widening = dst_dtype == DType::kFloat32 &&
                        (src_dtype == DType::kFloat16 || src_dtype == DType::kBFloat16);
  HEMIOLA_CHECK(narrowing || widening, "cast: unsupported conversion ", dtype_name(src_dtype),
                " -> ", dtype_name(dst_dtype), " (float32 <-> float16/bfloat16 only)");
  if (numel == 0) return;
  if (src_dtype == DType::kFloat16) return launch_cast<__half, float>(src, dst, numel, stream);
  if (src_dtype == DType::kBFloat16) {
    return launch_cast<__nv_bfloat16, float>(src, dst, numel, stream);
  }
  if (dst_dtype == DType::kFloat16) return launch_cast<float, __half>(src, dst, numel, stream);
  launch_cast<float, __nv_bfloat16>(src, dst, numel, stream);
}

void cast_divide(const float* src, void* dst, DType half, std::int64_t numel, float divisor,
                 void* stream) {
  HEMIOLA_CHECK(numel >= 0, "cast_divide: negative element count ", numel);
  HEMIOLA_CHECK(numel == 0 || (src && dst), "cast_divide: null pointer");
  HEMIOLA_CHECK(half == DType::kFloat16 || half == DType::kBFloat16,
                "cast_divide: the target is float16 or bfloat16, not ", dtype_name(half));
  HEMIOLA_CHECK(divisor > 0.0f, "cast_divide: divisor ", divisor, " is not positive");
  if (numel == 0) return;
  if (half == DType::kFloat16) return launch_cast_divide<__half>(src, dst, numel, divisor, stream);
  launch_cast_divide<__nv_bfloat16>(src, dst, numel, divisor, stream);
}

}  // namespace hemiola::cuda
