// The engine's optimizer: torch.optim's SGD (momentum, dampening, Nesterov,
// weight decay, maximize) and Adam / AdamW (amsgrad on the CPU), one step over
// one tensor, on the CPU (plain loops the compiler vectorises) or on a GPU (the
// fused kernels of cuda/kernels.h, enqueued on a stream). One implementation
// serves the parameter server and the schedules.
//
// Parameters, gradients and state share one floating dtype (float32, float64,
// float16 or bfloat16, as torch.optim keeps them). On the CPU the arithmetic
// follows torch's single-tensor step op by op, rounding to the dtype where
// torch's intermediate tensors do, so that a float16/bfloat16 step stays within
// rounding of torch's; the GPU kernels compute in float and round once.
//
// `shadow` is the exact, globally agreed copy of the parameters and state; the
// live parameters `param` are what forward reads. A step either *commits* (the
// exact step: shadow and state advance, and param receives the new values) or
// does not (the approximate step of the decoupled schedule: only param is
// written, computed from the shadow and the state, which stay as they were).
// Live and shadow may be the same memory when committing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hemiola/export.h"
#include "hemiola/tensor.h"

namespace hemiola {

// The optimizers the engine steps itself, for the schedules' Updater and the
// parameter server alike (the values are part of the server's snapshots).
enum class OptimizerKind : std::int32_t { kSgd = 0, kAdam = 1, kAdamW = 2 };

// The kind torch.optim names "sgd", "adam" or "adamw"; anything else throws,
// naming the three.
HEMIOLA_API OptimizerKind optimizer_kind(const std::string& name);

// One parameter group's hyper-parameters, with torch.optim's names: the one
// vocabulary of the schedules' Updater, the parameter server and the bindings
// (hemiola._C.optim.Hyper). SGD reads lr, momentum, dampening, weight_decay,
// nesterov and maximize; Adam/AdamW lr, beta1, beta2, eps, weight_decay,
// maximize and amsgrad. Doubles, as torch holds them (Python floats).
struct OptimizerHyper {
  double lr = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  // SGD and Adam: added to the gradient; AdamW: decoupled
  bool nesterov = false;
  bool maximize = false;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  bool amsgrad = false;
};

HEMIOLA_API bool operator==(const OptimizerHyper& a, const OptimizerHyper& b);
inline bool operator!=(const OptimizerHyper& a, const OptimizerHyper& b) { return !(a == b); }

// One torch.optim.SGD step of one tensor: the group's hyper-parameters and
// what belongs to this step alone.
struct SgdHyper : OptimizerHyper {
  // True on the step that creates the momentum buffer (torch: buf = d_p);
  // the buffer's old contents are then not read.
  bool first_step = false;
  // The gradient is scaled by this first (clip_grad_norm_'s coefficient),
  // rounded to the dtype as torch's `grad * coef` is.
  double grad_scale = 1.0;
  // A GPU only: the gradient is scaled by the double here as well, read by
  // the kernel when it runs (a coefficient computed on the device; null:
  // none). The CPU refuses it.
  const double* grad_scale_device = nullptr;
};

struct SgdTensors {
  void* param;           // live parameters (written)
  void* shadow;          // exact parameters (read; written when committing)
  void* momentum;        // momentum buffer (read unless first_step; written when committing);
                         // unused (may be null) when momentum == 0
  const void* grad;      // the gradient this step applies
};

// One torch.optim.SGD step:
//   g = ±(grad * grad_scale) + weight_decay * shadow
//   buf' = first_step ? g : momentum * buf + (1 - dampening) * g
//   d = momentum == 0 ? g : nesterov ? g + momentum * buf' : buf'
//   param = shadow - lr * d;   when committing also shadow = param, buf = buf'.
// `stream` is used on a GPU only (the step is enqueued there); on the CPU the
// step is done when this returns.
HEMIOLA_API void sgd_step(const SgdTensors& tensors, std::int64_t numel, DType dtype,
                          const Device& device, const SgdHyper& hyper, bool commit,
                          StreamRef stream = {});

// A vector square root, out[i] = sqrt(in[i]) for i < *n, in the calling
// convention of MKL's VSSQRT_/VDSQRT_ (n by pointer; a 64-bit count whose low
// half is the count too, so an LP64 and an ILP64 MKL read it alike).
using VectorSqrtF32 = void (*)(const std::int64_t* n, const float* in, float* out);
using VectorSqrtF64 = void (*)(const std::int64_t* n, const double* in, double* out);

// The square root the CPU Adam step takes of its second moment, for float32
// and float64 (float16 and bfloat16 take the correctly rounded float root, as
// torch does). Null: std::sqrt, IEEE's correctly rounded root. torch's own CPU
// sqrt is not always that one (x86-64 wheels take MKL's, which differs in the
// last bit for about one input in six), so to be torch's step bit for bit the
// step must take torch's: the Python layer finds it and checks it
// (hemiola.torch_math).
struct VectorSqrt {
  VectorSqrtF32 f32 = nullptr;
  VectorSqrtF64 f64 = nullptr;
};

// One torch.optim.Adam / AdamW step of one tensor: the group's
// hyper-parameters (amsgrad on the CPU only; the GPU refuses it) and what
// belongs to this step alone.
struct AdamHyper : OptimizerHyper {
  bool decoupled_weight_decay = false;  // AdamW
  std::int64_t step = 1;  // the step being taken, counted from 1 (bias correction)
  double grad_scale = 1.0;  // as SgdHyper::grad_scale
  const double* grad_scale_device = nullptr;  // as SgdHyper::grad_scale_device
  VectorSqrt sqrt = {};     // the CPU step's square root (see VectorSqrt)
};

struct AdamTensors {
  void* param;        // live parameters (written)
  void* shadow;       // exact parameters (read; written when committing)
  void* exp_avg;      // first moment (read; written when committing)
  void* exp_avg_sq;   // second moment (read; written when committing)
  const void* grad;   // the gradient this step applies
  void* max_exp_avg_sq = nullptr;  // amsgrad: running maximum of exp_avg_sq (as exp_avg)
};

// One torch.optim.Adam (or AdamW) step, with torch's formulas:
//   g = ±(grad * grad_scale) (+ weight_decay * shadow for Adam)
//   w = shadow (* (1 - lr * weight_decay) for AdamW)
//   m' = lerp(m, g, 1 - beta1);  v' = beta2 * v + (1 - beta2) * g * g
//   v^ = amsgrad ? max(vmax, v') : v'   (when committing with amsgrad, vmax = v^)
//   param = w - lr / (1 - beta1^step) * m' / (sqrt(v^) / sqrt(1 - beta2^step) + eps)
// When committing also shadow = param, exp_avg = m', exp_avg_sq = v'.
HEMIOLA_API void adam_step(const AdamTensors& tensors, std::int64_t numel, DType dtype,
                           const Device& device, const AdamHyper& hyper, bool commit,
                           StreamRef stream = {});

// One tensor's step in a multi-tensor call.
struct SgdStep {
  SgdTensors tensors;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
  SgdHyper hyper;
};

struct AdamStep {
  AdamTensors tensors;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
  AdamHyper hyper;
};

// sgd_step / adam_step on each of `steps`, all on `device`. On a GPU in one
// kernel launch per run of up to 24 steps of one dtype (a landing group's
// parameters at once, instead of a launch each); on the CPU one after the
// other. Every step is checked before any is taken.
HEMIOLA_API void sgd_steps(const std::vector<SgdStep>& steps, const Device& device, bool commit,
                           StreamRef stream = {});
HEMIOLA_API void adam_steps(const std::vector<AdamStep>& steps, const Device& device,
                            bool commit, StreamRef stream = {});

}  // namespace hemiola
