// The scale one iteration's update takes from the whole averaged gradient:
// torch.nn.utils.clip_grad_norm_'s coefficient and a GradScaler's skip (some
// element not finite, so no rank applies the update). Both need every
// gradient of the iteration, which is why the updater computes them once per
// iteration, when its first parameter lands.
#pragma once

#include <cstdint>
#include <vector>

#include "hemiola/tensor.h"

namespace hemiola::optim {

struct GlobalScale {
  // Some averaged gradient holds NaN or infinity (computed only when asked).
  bool skip = false;
  // clip_grad_norm_'s coefficient, min(1, max_norm / (total + 1e-6)); 1
  // without clipping.
  double coef = 1.0;
  // The total norm clip_grad_norm_ returns (clipping only).
  double total_norm = 0.0;
};

// A gradient the host can read.
struct HostGrad {
  const void* data = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

// The scale of the gradients `grads` (a parameter no rank used is left out by
// the caller). `clip_max_norm` < 0: no clipping, and the finiteness check
// then reads the 2-norm. `total_norm`, if given, is the caller's total norm
// of `grads` (torch's, summed in its order: UpdaterOptions::clip_norm),
// clipped by instead of this function's own.
GlobalScale global_scale(const std::vector<HostGrad>& grads, double clip_max_norm,
                         double clip_norm_type, bool skip_if_not_finite,
                         const double* total_norm = nullptr);

}  // namespace hemiola::optim
