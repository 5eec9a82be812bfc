// The fused optimizer steps of the decoupled schedule, single- and
// multi-tensor, which the optimizer (optimizer.cpp) launches for CUDA tensors.
//
// Plain C++ interface, callable from code compiled without nvcc: raw device
// pointers, element counts, hemiola::DType and an opaque stream (a
// cudaStream_t passed as void*; nullptr is the legacy default stream). Every
// function only enqueues work on `stream` and returns: the host never waits.
// Arguments are checked on the host (hemiola::Error, kInvalidArgument); a
// failed launch throws hemiola::Error (a std::runtime_error) whose message
// starts with the file:line of the launch. Empty work launches nothing.
//
// Compiled with nvcc in a CUDA build; without CUDA, step_kernels_unavailable.cpp
// refuses instead.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hemiola/export.h"
#include "hemiola/step_types.h"
#include "hemiola/tensor.h"

namespace hemiola::cuda {

// Parameters, gradients and optimizer state share one floating dtype (float32,
// float16 or bfloat16, as torch.optim keeps them); arithmetic is in float.
// `shadow` is the exact, globally agreed copy of the parameters and state; the
// live parameters `param` are what forward reads. A step either *commits*
// (the exact step with the averaged gradient: shadow and state advance, and
// param receives the new exact values) or does not (the approximate step with
// this rank's own gradient: only param is written, from the shadow). Live and
// shadow may be the same memory when committing.

// The hyper-parameters and tensors of one step are hemiola/step_types.h's
// (hemiola/optimizer.h's sgd_step/adam_step dispatch here for CUDA tensors).
using SgdHyper = ::hemiola::SgdHyper;
using SgdTensors = ::hemiola::SgdTensors;
using AdamHyper = ::hemiola::AdamHyper;
using AdamTensors = ::hemiola::AdamTensors;
using SgdStep = ::hemiola::SgdStep;
using AdamStep = ::hemiola::AdamStep;

// One torch.optim.SGD step (weight decay, momentum with dampening, Nesterov,
// maximize), in one launch:
//   g = ±grad + weight_decay * shadow
//   buf' = first_step ? g : momentum * buf + (1 - dampening) * g
//   d = momentum == 0 ? g : nesterov ? g + momentum * buf' : buf'
//   param = shadow - lr * d;   when committing also shadow = param, buf = buf'.
HEMIOLA_API void sgd_step(const SgdTensors& tensors, std::int64_t numel, DType dtype,
                          const SgdHyper& hyper, bool commit, void* stream);

// One torch.optim.Adam (or AdamW) step, in one launch, with torch's formulas:
//   g = ±grad (+ weight_decay * shadow for Adam)
//   w = shadow (* (1 - lr * weight_decay) for AdamW)
//   m' = lerp(m, g, 1 - beta1);  v' = beta2 * v + (1 - beta2) * g * g
//   param = w - lr / (1 - beta1^step) * m' / (sqrt(v') / sqrt(1 - beta2^step) + eps)
// When committing also shadow = param, exp_avg = m', exp_avg_sq = v'.
HEMIOLA_API void adam_step(const AdamTensors& tensors, std::int64_t numel, DType dtype,
                           const AdamHyper& hyper, bool commit, void* stream);

// The same steps as sgd_step / adam_step on each of `steps`, in one launch
// per run of up to 24 consecutive steps of one dtype (each with its own
// hyper-parameters). Every step is checked before anything is launched.
HEMIOLA_API void sgd_steps(const SgdStep* steps, size_t count, bool commit, void* stream);
HEMIOLA_API void adam_steps(const AdamStep* steps, size_t count, bool commit, void* stream);

}  // namespace hemiola::cuda
