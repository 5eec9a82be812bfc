// Kernels behind kernels.h. Design notes:
//
// Unpacking a fusion buffer splits the *buffer* into fixed chunks of kChunk
// elements, one block per chunk; a block finds the first slot overlapping its
// chunk by one binary search over the slot offsets (by one thread, shared
// through shared memory) and walks forward over the slots its chunk touches.
// Compared with assigning blocks per tensor, this balances load whatever the
// size mix (a 64-element bias does not occupy a whole block, a 2M-element
// weight is split evenly), the grid is simply ceil(extent / kChunk), and
// every access to the buffer side is coalesced across slot boundaries. The
// search costs log2(slots) dependent loads of a few hundred bytes that stay in
// L2, hidden behind other resident blocks' traffic. A chunk that lies inside
// one slot (nearly all of them for large tensors) takes an unrolled path that
// issues all kItems loads of a thread before its stores, so each thread keeps
// kItems requests in flight, which is what a bandwidth-bound copy needs.
//
// Element-wise kernels (casts, optimizer steps) use a grid-stride loop over a
// grid capped at kMaxBlocks, so any size launches a valid grid.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "hemiola/status.h"
#include "kernels.h"

namespace hemiola::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;
constexpr std::int64_t kChunk = std::int64_t{kThreads} * kItems;
constexpr std::int64_t kMaxBlocks = 1 << 16;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Throws hemiola::Error naming the launch site when the last launch failed.
void check_launch(const char* file, int line, const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    detail::throw_error(ErrorCode::kInternal, file, line,
                        detail::concat(kernel, " launch failed: ", cudaGetErrorName(status), ": ",
                                       cudaGetErrorString(status)));
  }
}
#define HEMIOLA_CHECK_LAUNCH(kernel) check_launch(__FILE__, __LINE__, kernel)

unsigned elementwise_blocks(std::int64_t numel) {
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

// Rounds a float through T, so that state carried in T is used as stored.
template <typename T>
__device__ float round_through(float x) {
  return Elem<T>::to_math(Elem<T>::from_math(x));
}

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

// Calls fn(Tag<U>{}) with U an unsigned integer as wide as one element.
template <typename Fn>
void dispatch_raw(DType dtype, Fn&& fn) {
  switch (dtype_size(dtype)) {
    case 1: return fn(Tag<std::uint8_t>{});
    case 2: return fn(Tag<std::uint16_t>{});
    case 4: return fn(Tag<std::uint32_t>{});
    case 8: return fn(Tag<std::uint64_t>{});
    default: HEMIOLA_THROW(ErrorCode::kInternal, "no raw type for ", dtype_name(dtype));
  }
}

// ---- fusion ---------------------------------------------------------------

// Index of the last slot with offset <= position, or -1 when there is none.
__device__ std::int64_t last_slot_at_or_before(const FusionSlot* slots, std::int64_t count,
                                               std::int64_t position) {
  std::int64_t low = 0;
  std::int64_t high = count;  // invariant: slots[< low] <= position < slots[>= high]
  while (low < high) {
    const std::int64_t mid = low + (high - low) / 2;
    if (slots[mid].offset <= position) {
      low = mid + 1;
    } else {
      high = mid;
    }
  }
  return low - 1;
}

// Unpack copies buffer -> tensor through Transform (a raw copy, or a
// scaling). One block per kChunk of the buffer.
struct RawCopy {
  template <typename T>
  __device__ T operator()(T x) const {
    return x;
  }
};

template <typename T>
struct Scale {
  typename Elem<T>::Math factor;
  __device__ T operator()(T x) const {
    return Elem<T>::from_math(Elem<T>::to_math(x) * factor);
  }
};

template <typename T, typename Transform>
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(const FusionSlot* __restrict__ slots, std::int64_t count,
                  const T* __restrict__ buffer, Transform transform) {
  __shared__ std::int64_t first_slot;
  const std::int64_t chunk_begin = static_cast<std::int64_t>(blockIdx.x) * kChunk;
  const std::int64_t chunk_end = chunk_begin + kChunk;
  if (threadIdx.x == 0) first_slot = last_slot_at_or_before(slots, count, chunk_begin);
  __syncthreads();

  for (std::int64_t s = first_slot < 0 ? 0 : first_slot; s < count; ++s) {
    const FusionSlot slot = slots[s];  // same address in every thread: one broadcast load
    if (slot.offset >= chunk_end) break;
    const std::int64_t slot_end = slot.offset + slot.numel;
    const std::int64_t begin = slot.offset > chunk_begin ? slot.offset : chunk_begin;
    const std::int64_t end = slot_end < chunk_end ? slot_end : chunk_end;
    if (begin >= end) continue;  // the chunk starts in the gap after this slot
    T* tensor = static_cast<T*>(slot.data);
    const std::int64_t shift = slot.offset;  // buffer index - tensor index
    if (end - begin == kChunk) {
      T values[kItems];
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        values[k] = buffer[begin + k * kThreads + threadIdx.x];
      }
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const std::int64_t i = begin + k * kThreads + threadIdx.x;
        tensor[i - shift] = transform(values[k]);
      }
    } else {
      for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
        tensor[i - shift] = transform(buffer[i]);
      }
    }
  }
}

void check_fusion_args(const FusionSlot* slots, std::int64_t slot_count, std::int64_t extent,
                       const void* buffer) {
  HEMIOLA_CHECK(slot_count >= 0 && extent >= 0, "fusion: negative slot count ", slot_count,
                " or extent ", extent);
  HEMIOLA_CHECK(slot_count == 0 || extent == 0 || (slots && buffer),
                "fusion: null slot array or buffer");
  HEMIOLA_CHECK((extent + kChunk - 1) / kChunk <= INT32_MAX, "fusion: extent ", extent,
                " is too large for one launch");
}

template <typename T, typename Transform>
void launch_unpack(const FusionSlot* slots, std::int64_t slot_count, std::int64_t extent,
                   const void* buffer, Transform transform, void* stream) {
  const auto blocks = static_cast<unsigned>((extent + kChunk - 1) / kChunk);
  unpack_kernel<T><<<blocks, kThreads, 0, as_stream(stream)>>>(
      slots, slot_count, static_cast<const T*>(buffer), transform);
  HEMIOLA_CHECK_LAUNCH("unpack");
}

// ---- casts ----------------------------------------------------------------

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

// ---- SGD ------------------------------------------------------------------

// Float constants of one SGD step, derived on the host in double.
struct SgdArgs {
  float lr;
  float momentum;
  float one_minus_dampening;
  float weight_decay;
  float sign;  // the gradient's factor: grad_scale, negated under maximize
  bool nesterov;
  bool first_step;
  const double* scale;  // null, or a further factor in device memory (device clipping)
};

// Every rounding of a step is spelt out (__fmul_rn, __fadd_rn, fmaf): left to
// the compiler, a multiply and an add may be fused into one rounding in one
// kernel that inlines these functions and not in another, and the
// multi-tensor kernels must give the single-tensor ones' bits (measured on an
// H100: 3e-8 apart after 5 SGD steps before this).
//
// param, shadow and momentum are not __restrict__: param and shadow may be the
// same memory (a committing step without a shadow copy). Each element is read
// before it is written by the same thread, so aliasing is harmless. Elements
// first, first + stride, ... < numel: one tensor's share of a block.
template <typename T>
__device__ void sgd_elements(T* param, T* shadow, T* momentum, const T* __restrict__ grad,
                             std::int64_t numel, const SgdArgs& args, bool commit,
                             std::int64_t first, std::int64_t stride) {
  using E = Elem<T>;
  const float sign = args.scale ? __fmul_rn(args.sign, static_cast<float>(*args.scale)) : args.sign;
  for (std::int64_t i = first; i < numel; i += stride) {
    const float w = E::to_math(shadow[i]);
    float g = __fmul_rn(sign, E::to_math(grad[i]));
    if (args.weight_decay != 0.0f) g = fmaf(args.weight_decay, w, g);
    float d = g;
    if (args.momentum != 0.0f) {
      const float buf = args.first_step ? g
                                        : fmaf(args.momentum, E::to_math(momentum[i]),
                                               __fmul_rn(args.one_minus_dampening, g));
      // torch keeps the buffer in T and Nesterov reads it back from there.
      const float stored = round_through<T>(buf);
      d = args.nesterov ? fmaf(args.momentum, stored, g) : stored;
      if (commit) momentum[i] = E::from_math(stored);
    }
    const T updated = E::from_math(fmaf(-args.lr, d, w));
    param[i] = updated;
    if (commit) shadow[i] = updated;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sgd_step_kernel(T* param, T* shadow, T* momentum, const T* __restrict__ grad,
                    std::int64_t numel, SgdArgs args, bool commit) {
  sgd_elements<T>(param, shadow, momentum, grad, numel, args, commit,
                  static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<std::int64_t>(blockDim.x) * gridDim.x);
}

void check_sgd_hyper(const SgdHyper& hyper) {
  HEMIOLA_CHECK(hyper.lr >= 0.0, "sgd: invalid learning rate ", hyper.lr);
  HEMIOLA_CHECK(hyper.momentum >= 0.0, "sgd: invalid momentum ", hyper.momentum);
  HEMIOLA_CHECK(hyper.weight_decay >= 0.0, "sgd: invalid weight_decay ", hyper.weight_decay);
  HEMIOLA_CHECK(!hyper.nesterov || (hyper.momentum > 0.0 && hyper.dampening == 0.0),
                "sgd: Nesterov momentum requires a momentum and zero dampening");
}

// ---- Adam / AdamW -------------------------------------------------------

// Float constants of one Adam step, derived on the host in double.
struct AdamArgs {
  float step_size;         // lr / (1 - beta1^step)
  float bias2_sqrt;        // sqrt(1 - beta2^step)
  float eps;
  float lerp_weight;       // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float coupled_decay;     // Adam: added to the gradient (times w); 0 for AdamW
  float decoupled_factor;  // AdamW: 1 - lr * weight_decay; 1 for Adam
  float sign;              // the gradient's factor: grad_scale, negated under maximize
  const double* scale;     // as SgdArgs::scale
};

// torch's lerp (at::lerp): exact at both ends, the form chosen by the weight.
__device__ float torch_lerp(float start, float end, float weight) {
  const float diff = __fsub_rn(end, start);
  return weight < 0.5f ? fmaf(weight, diff, start) : fmaf(-diff, __fsub_rn(1.0f, weight), end);
}

template <typename T>
__device__ void adam_elements(T* param, T* shadow, T* exp_avg, T* exp_avg_sq,
                              const T* __restrict__ grad, std::int64_t numel,
                              const AdamArgs& args, bool commit, std::int64_t first,
                              std::int64_t stride) {
  using E = Elem<T>;
  const float sign = args.scale ? __fmul_rn(args.sign, static_cast<float>(*args.scale)) : args.sign;
  for (std::int64_t i = first; i < numel; i += stride) {
    const float shadow_w = E::to_math(shadow[i]);
    float g = __fmul_rn(sign, E::to_math(grad[i]));
    // Tested rather than always added, as torch does: 0 * inf would be NaN.
    if (args.coupled_decay != 0.0f) g = fmaf(args.coupled_decay, shadow_w, g);
    const float w = __fmul_rn(shadow_w, args.decoupled_factor);
    // Moments are rounded through T as torch stores them before reading them.
    const float m = round_through<T>(torch_lerp(E::to_math(exp_avg[i]), g, args.lerp_weight));
    const float v = round_through<T>(fmaf(args.beta2, E::to_math(exp_avg_sq[i]),
                                          __fmul_rn(__fmul_rn(args.one_minus_beta2, g), g)));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), args.bias2_sqrt), args.eps);
    const T updated = E::from_math(fmaf(-args.step_size, __fdiv_rn(m, denom), w));
    param[i] = updated;
    if (commit) {
      shadow[i] = updated;
      exp_avg[i] = E::from_math(m);
      exp_avg_sq[i] = E::from_math(v);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    adam_step_kernel(T* param, T* shadow, T* exp_avg, T* exp_avg_sq, const T* __restrict__ grad,
                     std::int64_t numel, AdamArgs args, bool commit) {
  adam_elements<T>(param, shadow, exp_avg, exp_avg_sq, grad, numel, args, commit,
                   static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                   static_cast<std::int64_t>(blockDim.x) * gridDim.x);
}

void check_adam_hyper(const AdamHyper& hyper) {
  HEMIOLA_CHECK(!hyper.amsgrad, "adam: amsgrad is not supported by the fused step");
  HEMIOLA_CHECK(hyper.lr >= 0.0, "adam: invalid learning rate ", hyper.lr);
  HEMIOLA_CHECK(hyper.beta1 >= 0.0 && hyper.beta1 < 1.0, "adam: invalid beta1 ", hyper.beta1);
  HEMIOLA_CHECK(hyper.beta2 >= 0.0 && hyper.beta2 < 1.0, "adam: invalid beta2 ", hyper.beta2);
  HEMIOLA_CHECK(hyper.eps >= 0.0, "adam: invalid eps ", hyper.eps);
  HEMIOLA_CHECK(hyper.weight_decay >= 0.0, "adam: invalid weight_decay ", hyper.weight_decay);
  HEMIOLA_CHECK(hyper.step >= 1, "adam: step counts from 1, got ", hyper.step);
}

}  // namespace

void unpack(const FusionSlot* slots, std::int64_t slot_count, std::int64_t extent, DType dtype,
            const void* buffer, double scale, void* stream) {
  check_fusion_args(slots, slot_count, extent, buffer);
  HEMIOLA_CHECK(scale == 1.0 || is_floating(dtype), "unpack: cannot scale ", dtype_name(dtype));
  if (slot_count == 0 || extent == 0) return;
  if (scale == 1.0) {
    dispatch_raw(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_unpack<T>(slots, slot_count, extent, buffer, RawCopy{}, stream);
    });
    return;
  }
  dispatch_floating(dtype, /*with_double=*/true, "unpack with scale", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const Scale<T> transform{static_cast<typename Elem<T>::Math>(scale)};
    launch_unpack<T>(slots, slot_count, extent, buffer, transform, stream);
  });
}

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

namespace {

void check_sgd(const SgdTensors& tensors, std::int64_t numel, DType dtype,
               const SgdHyper& hyper) {
  check_sgd_hyper(hyper);
  HEMIOLA_CHECK(numel >= 0, "sgd: negative element count ", numel);
  HEMIOLA_CHECK(numel == 0 || (tensors.param && tensors.shadow && tensors.grad),
                "sgd: null parameter, shadow or gradient");
  HEMIOLA_CHECK(numel == 0 || hyper.momentum == 0.0 || tensors.momentum,
                "sgd: momentum ", hyper.momentum, " needs a momentum buffer");
  dispatch_floating(dtype, /*with_double=*/false, "sgd", [](auto) {});
}

SgdArgs sgd_args(const SgdHyper& hyper) {
  return SgdArgs{static_cast<float>(hyper.lr),
                 static_cast<float>(hyper.momentum),
                 static_cast<float>(1.0 - hyper.dampening),
                 static_cast<float>(hyper.weight_decay),
                 static_cast<float>(hyper.maximize ? -hyper.grad_scale : hyper.grad_scale),
                 hyper.nesterov,
                 hyper.first_step,
                 hyper.grad_scale_device};
}

void check_adam(const AdamTensors& tensors, std::int64_t numel, DType dtype,
                const AdamHyper& hyper) {
  check_adam_hyper(hyper);
  HEMIOLA_CHECK(numel >= 0, "adam: negative element count ", numel);
  HEMIOLA_CHECK(numel == 0 || (tensors.param && tensors.shadow && tensors.exp_avg &&
                               tensors.exp_avg_sq && tensors.grad),
                "adam: null parameter, shadow, moment or gradient");
  dispatch_floating(dtype, /*with_double=*/false, "adam", [](auto) {});
}

AdamArgs adam_args(const AdamHyper& hyper) {
  const double step = static_cast<double>(hyper.step);
  const bool decoupled = hyper.decoupled_weight_decay;
  return AdamArgs{
      static_cast<float>(hyper.lr / (1.0 - std::pow(hyper.beta1, step))),
      static_cast<float>(std::sqrt(1.0 - std::pow(hyper.beta2, step))),
      static_cast<float>(hyper.eps),
      static_cast<float>(1.0 - hyper.beta1),
      static_cast<float>(hyper.beta2),
      static_cast<float>(1.0 - hyper.beta2),
      decoupled ? 0.0f : static_cast<float>(hyper.weight_decay),
      decoupled ? static_cast<float>(1.0 - hyper.lr * hyper.weight_decay) : 1.0f,
      static_cast<float>(hyper.maximize ? -hyper.grad_scale : hyper.grad_scale),
      hyper.grad_scale_device};
}

// ---- multi-tensor steps ----------------------------------------------------
//
// Up to kBatch tensors of one dtype in one launch, passed by value as the
// kernel's argument (about 2 KB, under the 4 KB every CUDA version accepts),
// so nothing is uploaded and nothing must outlive the launch. Block row y
// steps tensor y with a grid-stride loop; rows of small tensors finish early.

constexpr int kBatch = 24;

template <typename Args>
struct StepBatch {
  void* param[kBatch];
  void* shadow[kBatch];
  void* state_a[kBatch];  // SGD: the momentum buffer; Adam: exp_avg
  void* state_b[kBatch];  // Adam: exp_avg_sq
  const void* grad[kBatch];
  std::int64_t numel[kBatch];
  Args args[kBatch];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) sgd_batch_kernel(StepBatch<SgdArgs> b, bool commit) {
  const int t = blockIdx.y;
  sgd_elements<T>(static_cast<T*>(b.param[t]), static_cast<T*>(b.shadow[t]),
                  static_cast<T*>(b.state_a[t]), static_cast<const T*>(b.grad[t]), b.numel[t],
                  b.args[t], commit,
                  static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<std::int64_t>(blockDim.x) * gridDim.x);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) adam_batch_kernel(StepBatch<AdamArgs> b, bool commit) {
  const int t = blockIdx.y;
  adam_elements<T>(static_cast<T*>(b.param[t]), static_cast<T*>(b.shadow[t]),
                   static_cast<T*>(b.state_a[t]), static_cast<T*>(b.state_b[t]),
                   static_cast<const T*>(b.grad[t]), b.numel[t], b.args[t], commit,
                   static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                   static_cast<std::int64_t>(blockDim.x) * gridDim.x);
}

// Launches `steps` (already checked) in batches of consecutive non-empty steps
// of one dtype. fill(batch, row, step) writes one step's pointers and args.
template <typename Args, typename Step, typename Fill, typename Launch>
void launch_batches(const Step* steps, size_t count, Fill&& fill, Launch&& launch) {
  size_t k = 0;
  while (k < count) {
    const DType dtype = steps[k].dtype;
    StepBatch<Args> batch{};
    int rows = 0;
    std::int64_t largest = 0;
    for (; k < count && rows < kBatch && steps[k].dtype == dtype; ++k) {
      if (steps[k].numel == 0) continue;
      fill(batch, rows++, steps[k]);
      largest = std::max(largest, steps[k].numel);
    }
    if (rows > 0) launch(dtype, batch, dim3(elementwise_blocks(largest), rows));
  }
}

// ---- clipping on the device -----------------------------------------------
//
// clip_grad_norm_ without the host: one batched kernel sums |x|^p of each
// gradient into sums[i] (atomically, one add per block), then one thread
// rounds the per-tensor norms, the total and the coefficient as
// optim/global_scale.cpp does on the host (count is the parameter count, a
// few hundred: a serial loop of microseconds).

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

void sgd_step(const SgdTensors& tensors, std::int64_t numel, DType dtype, const SgdHyper& hyper,
              bool commit, void* stream) {
  check_sgd(tensors, numel, dtype, hyper);
  if (numel == 0) return;
  const SgdArgs args = sgd_args(hyper);
  dispatch_floating(dtype, /*with_double=*/false, "sgd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    sgd_step_kernel<T><<<elementwise_blocks(numel), kThreads, 0, as_stream(stream)>>>(
        static_cast<T*>(tensors.param), static_cast<T*>(tensors.shadow),
        static_cast<T*>(tensors.momentum), static_cast<const T*>(tensors.grad), numel, args,
        commit);
    HEMIOLA_CHECK_LAUNCH("sgd_step");
  });
}

void adam_step(const AdamTensors& tensors, std::int64_t numel, DType dtype,
               const AdamHyper& hyper, bool commit, void* stream) {
  check_adam(tensors, numel, dtype, hyper);
  if (numel == 0) return;
  const AdamArgs args = adam_args(hyper);
  dispatch_floating(dtype, /*with_double=*/false, "adam", [&](auto tag) {
    using T = typename decltype(tag)::type;
    adam_step_kernel<T><<<elementwise_blocks(numel), kThreads, 0, as_stream(stream)>>>(
        static_cast<T*>(tensors.param), static_cast<T*>(tensors.shadow),
        static_cast<T*>(tensors.exp_avg), static_cast<T*>(tensors.exp_avg_sq),
        static_cast<const T*>(tensors.grad), numel, args, commit);
    HEMIOLA_CHECK_LAUNCH("adam_step");
  });
}

void sgd_steps(const SgdStep* steps, size_t count, bool commit, void* stream) {
  // Every step is checked before any launch: a refusal applies nothing.
  for (size_t k = 0; k < count; ++k) {
    check_sgd(steps[k].tensors, steps[k].numel, steps[k].dtype, steps[k].hyper);
  }
  launch_batches<SgdArgs>(
      steps, count,
      [](StepBatch<SgdArgs>& b, int row, const SgdStep& step) {
        b.param[row] = step.tensors.param;
        b.shadow[row] = step.tensors.shadow;
        b.state_a[row] = step.tensors.momentum;
        b.state_b[row] = nullptr;
        b.grad[row] = step.tensors.grad;
        b.numel[row] = step.numel;
        b.args[row] = sgd_args(step.hyper);
      },
      [&](DType dtype, const StepBatch<SgdArgs>& batch, dim3 grid) {
        dispatch_floating(dtype, /*with_double=*/false, "sgd", [&](auto tag) {
          using T = typename decltype(tag)::type;
          sgd_batch_kernel<T><<<grid, kThreads, 0, as_stream(stream)>>>(batch, commit);
          HEMIOLA_CHECK_LAUNCH("sgd_steps");
        });
      });
}

void adam_steps(const AdamStep* steps, size_t count, bool commit, void* stream) {
  for (size_t k = 0; k < count; ++k) {
    check_adam(steps[k].tensors, steps[k].numel, steps[k].dtype, steps[k].hyper);
  }
  launch_batches<AdamArgs>(
      steps, count,
      [](StepBatch<AdamArgs>& b, int row, const AdamStep& step) {
        b.param[row] = step.tensors.param;
        b.shadow[row] = step.tensors.shadow;
        b.state_a[row] = step.tensors.exp_avg;
        b.state_b[row] = step.tensors.exp_avg_sq;
        b.grad[row] = step.tensors.grad;
        b.numel[row] = step.numel;
        b.args[row] = adam_args(step.hyper);
      },
      [&](DType dtype, const StepBatch<AdamArgs>& batch, dim3 grid) {
        dispatch_floating(dtype, /*with_double=*/false, "adam", [&](auto tag) {
          using T = typename decltype(tag)::type;
          adam_batch_kernel<T><<<grid, kThreads, 0, as_stream(stream)>>>(batch, commit);
          HEMIOLA_CHECK_LAUNCH("adam_steps");
        });
      });
}

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
