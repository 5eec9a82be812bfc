// The engine's optimizer: torch.optim's SGD (momentum, dampening, Nesterov,
// weight decay, maximize) and Adam / AdamW (amsgrad on the CPU), one step over
// one tensor, on the CPU (plain loops the compiler vectorises) or on a GPU (the
// fused kernels of optim/step_kernels.h, enqueued on a stream). One implementation
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
#include "hemiola/step_types.h"
#include "hemiola/tensor.h"

namespace hemiola {

// The optimizers the engine steps itself, for the schedules' Updater and the
// parameter server alike (the values are part of the server's snapshots).
enum class OptimizerKind : std::int32_t { kSgd = 0, kAdam = 1, kAdamW = 2 };

// The kind torch.optim names "sgd", "adam" or "adamw"; anything else throws,
// naming the three.
HEMIOLA_API OptimizerKind optimizer_kind(const std::string& name);

HEMIOLA_API bool operator==(const OptimizerHyper& a, const OptimizerHyper& b);
inline bool operator!=(const OptimizerHyper& a, const OptimizerHyper& b) { return !(a == b); }

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

// sgd_step / adam_step on each of `steps`, all on `device`. On a GPU in one
// kernel launch per run of up to 24 steps of one dtype (a landing group's
// parameters at once, instead of a launch each); on the CPU one after the
// other. Every step is checked before any is taken.
HEMIOLA_API void sgd_steps(const std::vector<SgdStep>& steps, const Device& device, bool commit,
                           StreamRef stream = {});
HEMIOLA_API void adam_steps(const std::vector<AdamStep>& steps, const Device& device,
                            bool commit, StreamRef stream = {});

}  // namespace hemiola
