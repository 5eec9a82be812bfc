// The fusion buffer's unpack kernel, which the buckets floor launches to copy a
// reduced buffer back into its tensors.
//
// Plain C++ interface, callable from code compiled without nvcc: raw device
// pointers, element counts, hemiola::DType and an opaque stream (a
// cudaStream_t passed as void*; nullptr is the legacy default stream). Every
// function only enqueues work on `stream` and returns: the host never waits.
// Arguments are checked on the host (hemiola::Error, kInvalidArgument); a
// failed launch throws hemiola::Error (a std::runtime_error) whose message
// starts with the file:line of the launch. Empty work launches nothing.
//
// Compiled with nvcc in a CUDA build; without CUDA, unpack_kernel_unavailable.cpp
// refuses instead.
#pragma once

#include <cstdint>

#include "hemiola/export.h"
#include "hemiola/tensor.h"

namespace hemiola::cuda {

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

}  // namespace hemiola::cuda
