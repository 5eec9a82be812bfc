// The engine's CUDA kernels behind a plain C++ interface: raw device pointers,
// element counts, hemiola::DType and an opaque stream (a cudaStream_t passed as
// void*; nullptr is the legacy default stream). No CUDA or framework type
// appears here, so code compiled without nvcc can call these.
//
// Every function only enqueues work on `stream` and returns: the host never
// waits. Arguments are checked on the host (hemiola::Error, kInvalidArgument);
// a failed launch throws hemiola::Error (a std::runtime_error) whose message
// starts with the file:line of the launch. Empty work launches nothing.
#pragma once

#include <cstdint>

#include "hemiola/export.h"
#include "hemiola/step_types.h"
#include "hemiola/tensor.h"

namespace hemiola::cuda {

// ---- fusion buffers -----------------------------------------------------

// One tensor's place in a fusion buffer: `numel` elements at `data` occupy
// elements [offset, offset + numel) of the buffer. An array of slots lives in
// device memory (the caller uploads it once per bucket layout and keeps it
// while kernels using it may run). Invariant the kernels rely on (not checked:
// the array is on the device): slots[i].offset + slots[i].numel <=
// slots[i + 1].offset, and every slot lies inside the buffer. Gaps between
// slots (alignment padding) are allowed and never touched.
struct FusionSlot {
  void* data;
  std::int64_t offset;
  std::int64_t numel;
};
static_assert(sizeof(FusionSlot) == 24, "FusionSlot is uploaded as three 64-bit words");

// Copies `buffer` back into every slot's tensor, multiplied by `scale` (1/world
// to turn a sum into an average), in one launch. scale == 1 is a raw copy of
// any dtype; otherwise the dtype must be floating and the product is computed
// in float (double for float64) and rounded once to the dtype.
HEMIOLA_API void unpack(const FusionSlot* slots, std::int64_t slot_count, std::int64_t extent,
                        DType dtype, const void* buffer, double scale, void* stream);

// ---- casts (compressed wire format) --------------------------------------

// dst[i] = src[i] converted, for float32 -> float16/bfloat16 (round to nearest
// even, as torch's .to()) and float16/bfloat16 -> float32 (exact).
HEMIOLA_API void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                      std::int64_t numel, void* stream);

// dst[i] = half(float(half(src[i])) / divisor) for `half` float16 or bfloat16:
// cast, then divide in the half type, as torch's DDP hooks do with
// buffer.to(half).div_(world_size) (and the host's floats_to_halves).
HEMIOLA_API void cast_divide(const float* src, void* dst, DType half, std::int64_t numel,
                             float divisor, void* stream);

// ---- fused optimizer steps for the decoupled schedule ---------------------
//
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

// ---- clipping on the device ----------------------------------------------

// One gradient of clip_grad_norm_'s total norm.
struct NormInput {
  const void* data;
  std::int64_t numel;
  DType dtype;  // float32, float64, float16 or bfloat16
};

// torch.nn.utils.clip_grad_norm_'s coefficient over `inputs`, computed on
// the device so that the host never waits: out[0] = the coefficient
// min(1, max_norm / (total + 1e-6)) and out[1] = the total norm, rounded
// step by step as optim/global_scale.h does on the host (per-tensor norms and
// the total in the gradients' dtypes). `norm_type` > 0, finite or infinity.
// `sums` is device scratch of `count` doubles, `dtypes` a device array of
// `count` DType codes (inputs[i].dtype, uploaded by the caller and kept);
// `out` is device memory of two doubles, read by what is enqueued after.
HEMIOLA_API void clip_coefficient(const NormInput* inputs, size_t count,
                                  const std::int32_t* dtypes, double* sums, double norm_type,
                                  double max_norm, double* out, void* stream);

}  // namespace hemiola::cuda
