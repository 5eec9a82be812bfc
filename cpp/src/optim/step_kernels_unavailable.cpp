// step_kernels.h in a build without CUDA: refuses (compiled instead of
// step_kernels.cu).
#include "cuda/unavailable.h"
#include "optim/step_kernels.h"

namespace hemiola::cuda {

void sgd_step(const SgdTensors&, std::int64_t, DType, const SgdHyper&, bool, void*) {
  unavailable();
}
void adam_step(const AdamTensors&, std::int64_t, DType, const AdamHyper&, bool, void*) {
  unavailable();
}
void sgd_steps(const SgdStep*, size_t, bool, void*) { unavailable(); }
void adam_steps(const AdamStep*, size_t, bool, void*) { unavailable(); }

}  // namespace hemiola::cuda
