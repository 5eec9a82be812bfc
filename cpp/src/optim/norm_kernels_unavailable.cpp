// norm_kernels.h in a build without CUDA: refuses (compiled instead of
// norm_kernels.cu).
#include "cuda/unavailable.h"
#include "optim/norm_kernels.h"

namespace hemiola::cuda {

void clip_coefficient(const NormInput*, size_t, const std::int32_t*, double*, double, double,
                      double*, void*) {
  unavailable();
}

}  // namespace hemiola::cuda
