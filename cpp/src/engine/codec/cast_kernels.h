// The compressed wire's cast kernels, which the codec floor launches to
// narrow a bucket to float16/bfloat16 and widen it back.
//
// Plain C++ interface, callable from code compiled without nvcc: raw device
// pointers, element counts, hemiola::DType and an opaque stream (a
// cudaStream_t passed as void*; nullptr is the legacy default stream). Every
// function only enqueues work on `stream` and returns: the host never waits.
// Arguments are checked on the host (hemiola::Error, kInvalidArgument); a
// failed launch throws hemiola::Error (a std::runtime_error) whose message
// starts with the file:line of the launch. Empty work launches nothing.
//
// Compiled with nvcc in a CUDA build; without CUDA, cast_kernels_unavailable.cpp
// refuses instead.
#pragma once

#include <cstdint>

#include "hemiola/export.h"
#include "hemiola/tensor.h"

namespace hemiola::cuda {

// dst[i] = src[i] converted, for float32 -> float16/bfloat16 (round to nearest
// even, as torch's .to()) and float16/bfloat16 -> float32 (exact).
HEMIOLA_API void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                      std::int64_t numel, void* stream);

// dst[i] = half(float(half(src[i])) / divisor) for `half` float16 or bfloat16:
// cast, then divide in the half type, as torch's DDP hooks do with
// buffer.to(half).div_(world_size) (and the host's floats_to_halves).
HEMIOLA_API void cast_divide(const float* src, void* dst, DType half, std::int64_t numel,
                             float divisor, void* stream);

}  // namespace hemiola::cuda
