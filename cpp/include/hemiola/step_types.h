// The value types of one optimizer step: hyper-parameters and tensors, no
// functions. Shared by the optimizer's steps (hemiola/optimizer.h, where the
// formulas are) and the CUDA kernels that take them (optim/step_kernels.h),
// which therefore need nothing of the floors above them.
#pragma once

#include <cstdint>

#include "hemiola/tensor.h"

namespace hemiola {

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
// (hemiola.torch_sqrt).
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

}  // namespace hemiola
