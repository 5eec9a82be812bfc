// clip_grad_norm_'s coefficient on the device, which the updater's device
// clipping (engine/updater/device_clip.h) enqueues before the steps.
//
// Plain C++ interface, callable from code compiled without nvcc: raw device
// pointers, element counts, hemiola::DType and an opaque stream (a
// cudaStream_t passed as void*; nullptr is the legacy default stream). Every
// function only enqueues work on `stream` and returns: the host never waits.
// Arguments are checked on the host (hemiola::Error, kInvalidArgument); a
// failed launch throws hemiola::Error (a std::runtime_error) whose message
// starts with the file:line of the launch. Empty work launches nothing.
//
// Compiled with nvcc in a CUDA build; without CUDA, norm_kernels_unavailable.cpp
// refuses instead.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hemiola/export.h"
#include "hemiola/tensor.h"

namespace hemiola::cuda {

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
