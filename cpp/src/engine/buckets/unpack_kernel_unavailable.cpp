// unpack_kernel.h in a build without CUDA: refuses (compiled instead of
// unpack_kernel.cu).
#include "cuda/unavailable.h"
#include "engine/buckets/unpack_kernel.h"

namespace hemiola::cuda {

void unpack(const FusionSlot*, std::int64_t, std::int64_t, DType, const void*, double, void*) {
  unavailable();
}

}  // namespace hemiola::cuda
