// cast_kernels.h in a build without CUDA: refuses (compiled instead of
// cast_kernels.cu).
#include "cuda/unavailable.h"
#include "engine/codec/cast_kernels.h"

namespace hemiola::cuda {

void cast(const void*, DType, void*, DType, std::int64_t, void*) { unavailable(); }
void cast_divide(const float*, void*, DType, std::int64_t, float, void*) { unavailable(); }

}  // namespace hemiola::cuda
