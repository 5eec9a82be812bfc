// What the engine's kernel files (X_kernel(s).cu beside the floor that
// launches them) share, for nvcc only: the block size, launch checks, the
// element types' conversions to their arithmetic type, and the dtype dispatch.
//
// Element-wise kernels (casts, optimizer steps) use a grid-stride loop over a
// grid capped at kMaxBlocks, so any size launches a valid grid.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "hemiola/status.h"
#include "hemiola/tensor.h"

namespace hemiola::cuda {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 1 << 16;
// Tensors in one launch of a multi-tensor kernel (the optimizer's batched
// steps, clipping's norm sums), passed by value as the kernel's argument.
constexpr int kBatch = 24;

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Throws hemiola::Error naming the launch site when the last launch failed.
inline void check_launch(const char* file, int line, const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    detail::throw_error(ErrorCode::kInternal, file, line,
                        detail::concat(kernel, " launch failed: ", cudaGetErrorName(status), ": ",
                                       cudaGetErrorString(status)));
  }
}
#define HEMIOLA_CHECK_LAUNCH(kernel) ::hemiola::cuda::check_launch(__FILE__, __LINE__, kernel)

inline unsigned elementwise_blocks(std::int64_t numel) {
  return static_cast<unsigned>(std::min((numel + kThreads - 1) / kThreads, kMaxBlocks));
}

// ---- element types: storage T, arithmetic in Elem<T>::Math ----------------

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using Math = float;
  static __device__ float to_math(float x) { return x; }
  static __device__ float from_math(float x) { return x; }
};
template <>
struct Elem<double> {
  using Math = double;
  static __device__ double to_math(double x) { return x; }
  static __device__ double from_math(double x) { return x; }
};
template <>
struct Elem<__half> {
  using Math = float;
  static __device__ float to_math(__half x) { return __half2float(x); }
  static __device__ __half from_math(float x) { return __float2half_rn(x); }
};
template <>
struct Elem<__nv_bfloat16> {
  using Math = float;
  static __device__ float to_math(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __nv_bfloat16 from_math(float x) { return __float2bfloat16_rn(x); }
};

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) with T the storage type of `dtype`: float32, float16,
// bfloat16 and, when with_double, float64; anything else is refused.
template <typename Fn>
void dispatch_floating(DType dtype, bool with_double, const char* what, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(Tag<float>{});
    case DType::kFloat16: return fn(Tag<__half>{});
    case DType::kBFloat16: return fn(Tag<__nv_bfloat16>{});
    case DType::kFloat64:
      if (with_double) return fn(Tag<double>{});
      break;
    default: break;
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, what, ": unsupported dtype ", dtype_name(dtype));
}

}  // namespace hemiola::cuda
