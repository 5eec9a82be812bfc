// The fused SGD and Adam steps, single- and multi-tensor (step_kernels.h).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/kernel_support.cuh"
#include "hemiola/status.h"
#include "optim/step_kernels.h"

namespace hemiola::cuda {

namespace {

// Rounds a float through T, so that state carried in T is used as stored.
template <typename T>
__device__ float round_through(float x) {
  return Elem<T>::to_math(Elem<T>::from_math(x));
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

}  // namespace hemiola::cuda
