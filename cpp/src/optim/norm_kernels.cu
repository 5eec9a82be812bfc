// clip_grad_norm_'s coefficient on the device (norm_kernels.h), without the
// host: one batched kernel sums |x|^p of each gradient into sums[i]
// (atomically, one add per block), then one thread rounds the per-tensor
// norms, the total and the coefficient as optim/global_scale.cpp does on the
// host (count is the parameter count, a few hundred: a serial loop of
// microseconds).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/kernel_support.cuh"
#include "hemiola/status.h"
#include "optim/norm_kernels.h"

namespace hemiola::cuda {

namespace {

struct NormBatch {
  const void* data[kBatch];
  std::int64_t numel[kBatch];
  std::int32_t index[kBatch];  // where in `sums` this tensor's sum goes
};

// NaN sticks; otherwise the larger.
__device__ double max_or_nan(double a, double b) { return (isnan(b) || b > a) ? b : a; }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    norm_sums_kernel(NormBatch b, double p, bool inf_norm, double* sums) {
  using E = Elem<T>;
  const int t = blockIdx.y;
  const T* x = static_cast<const T*>(b.data[t]);
  double acc = 0.0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < b.numel[t]; i += static_cast<std::int64_t>(blockDim.x) * gridDim.x) {
    const double a = fabs(static_cast<double>(E::to_math(x[i])));
    acc = inf_norm ? max_or_nan(acc, a) : acc + (p == 2.0 ? a * a : pow(a, p));
  }
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const double other = partial[threadIdx.x + half];
      partial[threadIdx.x] =
          inf_norm ? max_or_nan(partial[threadIdx.x], other) : partial[threadIdx.x] + other;
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  double* target = &sums[b.index[t]];
  if (inf_norm) {
    // Non-negative doubles, and NaN (fabs clears its sign), order as their bits do.
    atomicMax(reinterpret_cast<unsigned long long*>(target),
              static_cast<unsigned long long>(__double_as_longlong(partial[0])));
  } else {
    atomicAdd(target, partial[0]);
  }
}

// optim/grad_norm.cpp's round_to and finish_norm, and global_scale.cpp's promote.
__device__ double round_to_dtype(std::int32_t dtype, double x) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat64: return x;
    case DType::kBFloat16:
      return static_cast<double>(__bfloat162float(__float2bfloat16_rn(static_cast<float>(x))));
    case DType::kFloat16:
      return static_cast<double>(__half2float(__float2half_rn(static_cast<float>(x))));
    default: return static_cast<double>(static_cast<float>(x));
  }
}

__device__ double finish_norm_of(double acc, double p) {
  if (isinf(p) || p == 1.0) return acc;
  if (p == 2.0) return sqrt(acc);
  return pow(acc, 1.0 / p);
}

__device__ std::int32_t promote_dtype(std::int32_t a, std::int32_t b) {
  const auto f64 = static_cast<std::int32_t>(DType::kFloat64);
  if (a == b) return a;
  if (a == f64 || b == f64) return f64;
  return static_cast<std::int32_t>(DType::kFloat32);
}

__global__ void clip_finish_kernel(const std::int32_t* dtypes, const double* sums, size_t count,
                                   double p, double max_norm, double* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const bool inf_norm = isinf(p);
  double rounded = 0.0;
  std::int32_t total_dtype = static_cast<std::int32_t>(DType::kBFloat16);
  for (size_t k = 0; k < count; ++k) {
    const double norm = round_to_dtype(dtypes[k], finish_norm_of(sums[k], p));
    rounded = inf_norm ? max_or_nan(rounded, norm) : rounded + pow(norm, p);
    total_dtype = k == 0 ? dtypes[k] : promote_dtype(total_dtype, dtypes[k]);
  }
  const std::int32_t d = total_dtype;
  const double total = round_to_dtype(d, inf_norm ? rounded : pow(rounded, 1.0 / p));
  // max_norm / x is reciprocal(x) * max_norm for a tensor x.
  const double inverse = round_to_dtype(d, 1.0 / round_to_dtype(d, total + 1e-6));
  const float product = static_cast<float>(inverse) * static_cast<float>(max_norm);
  const double coef = d == static_cast<std::int32_t>(DType::kFloat64)
                          ? inverse * max_norm
                          : round_to_dtype(d, static_cast<double>(product));
  out[0] = coef < 1.0 ? coef : 1.0;  // std::min(1.0, coef), as the host: NaN gives 1
  out[1] = total;
}

}  // namespace

void clip_coefficient(const NormInput* inputs, size_t count, const std::int32_t* dtypes,
                      double* sums, double norm_type, double max_norm, double* out,
                      void* stream) {
  HEMIOLA_CHECK(norm_type > 0.0, "clip: norm_type must be positive, got ", norm_type);
  HEMIOLA_CHECK(max_norm >= 0.0, "clip: negative max_norm ", max_norm);
  HEMIOLA_CHECK(out && (count == 0 || (inputs && dtypes && sums)), "clip: null argument");
  for (size_t k = 0; k < count; ++k) {
    HEMIOLA_CHECK(inputs[k].numel >= 0, "clip: negative element count ", inputs[k].numel);
    HEMIOLA_CHECK(inputs[k].numel == 0 || inputs[k].data, "clip: null gradient ", k);
    dispatch_floating(inputs[k].dtype, /*with_double=*/true, "clip", [](auto) {});
  }
  const bool inf_norm = std::isinf(norm_type);
  if (count > 0) {
    const cudaError_t zeroed = cudaMemsetAsync(sums, 0, count * sizeof(double), as_stream(stream));
    HEMIOLA_CHECK(zeroed == cudaSuccess, "clip: zeroing the sums failed: ",
                  cudaGetErrorString(zeroed));
  }
  size_t k = 0;
  while (k < count) {
    const DType dtype = inputs[k].dtype;
    NormBatch batch{};
    int rows = 0;
    std::int64_t largest = 0;
    for (; k < count && rows < kBatch && inputs[k].dtype == dtype; ++k) {
      if (inputs[k].numel == 0) continue;
      batch.data[rows] = inputs[k].data;
      batch.numel[rows] = inputs[k].numel;
      batch.index[rows] = static_cast<std::int32_t>(k);
      largest = std::max(largest, inputs[k].numel);
      ++rows;
    }
    if (rows == 0) continue;
    dispatch_floating(dtype, /*with_double=*/true, "clip", [&](auto tag) {
      using T = typename decltype(tag)::type;
      norm_sums_kernel<T>
          <<<dim3(elementwise_blocks(largest), rows), kThreads, 0, as_stream(stream)>>>(
              batch, norm_type, inf_norm, sums);
      HEMIOLA_CHECK_LAUNCH("clip norm sums");
    });
  }
  clip_finish_kernel<<<1, 1, 0, as_stream(stream)>>>(dtypes, sums, count, norm_type, max_norm,
                                                     out);
  HEMIOLA_CHECK_LAUNCH("clip coefficient");
}

}  // namespace hemiola::cuda
