// The parameter server's optimizer: the engine's own (hemiola/optimizer.h),
// committing in place on the server's float32 shards.
#include "ps/optimizer.h"

#include <algorithm>
#include <cmath>

#include "hemiola/optimizer.h"
#include "hemiola/status.h"

namespace hemiola::ps {

void optimizer_step(OptimizerState& state, float* param, const float* grad, int64_t n,
                    const Hyper& hyper, double lr_factor) {
  const double lr = hyper.lr * lr_factor;
  const Device cpu{};
  if (state.kind == OptimizerKind::kSgd) {
    SgdHyper h;
    h.lr = lr;
    h.momentum = hyper.momentum;
    h.dampening = hyper.dampening;
    h.weight_decay = hyper.weight_decay;
    h.nesterov = hyper.nesterov;
    h.first_step = hyper.momentum != 0.0 && !state.has_momentum;
    if (h.first_step) state.m.assign(static_cast<size_t>(n), 0.0f);
    sgd_step(SgdTensors{param, param, state.m.data(), grad}, n, DType::kFloat32, cpu, h, true);
    if (hyper.momentum != 0.0) state.has_momentum = true;
    return;
  }
  HEMIOLA_CHECK(state.kind == OptimizerKind::kAdam || state.kind == OptimizerKind::kAdamW,
                "unknown optimizer kind ", static_cast<int>(state.kind));
  if (state.m.size() != static_cast<size_t>(n)) {
    state.m.assign(static_cast<size_t>(n), 0.0f);
    state.v.assign(static_cast<size_t>(n), 0.0f);
  }
  AdamHyper h;
  h.lr = lr;
  h.beta1 = hyper.beta1;
  h.beta2 = hyper.beta2;
  h.eps = hyper.eps;
  h.weight_decay = hyper.weight_decay;
  h.decoupled_weight_decay = state.kind == OptimizerKind::kAdamW;
  h.step = ++state.step;
  adam_step(AdamTensors{param, param, state.m.data(), state.v.data(), grad}, n, DType::kFloat32,
            cpu, h, true);
}

void momentum_share_removed(const OptimizerState& state, const float* param, float* out,
                            int64_t n, const Hyper& hyper, double lr_factor) {
  // One pass over the shard either way: this runs for every eager pull.
  const double lr = hyper.lr * lr_factor;
  if (state.kind == OptimizerKind::kSgd) {
    if (!state.has_momentum || hyper.momentum == 0.0) {
      std::copy(param, param + n, out);
      return;
    }
    const auto scale = static_cast<float>(
        lr * hyper.momentum * (hyper.nesterov ? hyper.momentum : 1.0));
    for (int64_t i = 0; i < n; ++i) out[i] = param[i] - scale * state.m[static_cast<size_t>(i)];
    return;
  }
  if (state.step == 0 || state.m.size() != static_cast<size_t>(n)) {
    std::copy(param, param + n, out);
    return;
  }
  const auto t = static_cast<double>(state.step + 1);
  const auto a = static_cast<float>(lr * hyper.beta1 / (1.0 - std::pow(hyper.beta1, t)));
  const auto b = static_cast<float>(hyper.beta2 / (1.0 - std::pow(hyper.beta2, t)));
  const auto eps = static_cast<float>(hyper.eps);
  for (int64_t i = 0; i < n; ++i) {
    const auto j = static_cast<size_t>(i);
    out[i] = param[i] - a * state.m[j] / (std::sqrt(b * state.v[j]) + eps);
  }
}

}  // namespace hemiola::ps
