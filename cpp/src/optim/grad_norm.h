// Norms and finiteness of gradient buffers, as torch.nn.utils.clip_grad_norm_
// and the check_finite option see them: read in the buffer's dtype, summed in
// double.
#pragma once

#include <cstdint>

#include "hemiola/tensor.h"

namespace hemiola::optim {

// Accumulates one buffer into a p-norm: adds sum |x|^p to `acc` (p finite, >
// 0), or raises `acc` to max |x| (p = infinity). NaN propagates.
void accumulate_norm(const void* data, std::int64_t numel, DType dtype, double p, double& acc);
// The norm from an accumulator: acc^(1/p), or acc itself for p = infinity.
double finish_norm(double acc, double p);
// `x` rounded to `dtype`, as storing it in a tensor of that dtype does.
double round_to(DType dtype, double x);
// True when no element is NaN or infinite.
bool all_finite(const void* data, std::int64_t numel, DType dtype);

}  // namespace hemiola::optim
