// The parameter server's optimizer: the engine's own (hemiola/optimizer.h),
// committing in place on the server's float32 shards.
#include "ps/optimizer.h"

#include <algorithm>
#include <cmath>

#include "hemiola/optimizer.h"
#include "hemiola/status.h"

namespace hemiola::ps {

PushWeight push_weight(StalenessRule rule, int64_t tau, bool compensate_momentum) {
  tau = std::max<int64_t>(0, tau);
  const double f = staleness_factor(rule, tau);
  PushWeight w;
  if (compensate_momentum) {
    w.grad_scale = f;
    w.momentum_scale = 1.0 / (1.0 + static_cast<double>(tau));
  } else {
    w.lr_scale = f;
  }
  return w;
}

void optimizer_step(OptimizerState& state, float* param, const float* grad, int64_t n,
                    const Hyper& hyper, const PushWeight& weight) {
  const Device cpu{};
  if (state.kind == OptimizerKind::kSgd) {
    // grad_scale * (grad + weight_decay * param) as it enters the buffer.
    SgdHyper h;
    h.lr = hyper.lr * weight.lr_scale;
    h.momentum = hyper.momentum * weight.momentum_scale;
    h.dampening = hyper.dampening;
    h.grad_scale = weight.grad_scale;
    h.weight_decay = hyper.weight_decay * weight.grad_scale;
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
  h.lr = hyper.lr * weight.factor();
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
                            int64_t n, const Hyper& hyper, const PushWeight& weight) {
  // One pass over the shard either way: this runs for every eager pull.
  if (state.kind == OptimizerKind::kSgd) {
    if (!state.has_momentum || hyper.momentum == 0.0) {
      std::copy(param, param + n, out);
      return;
    }
    const double mu = hyper.momentum * weight.momentum_scale;
    const auto scale =
        static_cast<float>(hyper.lr * weight.lr_scale * mu * (hyper.nesterov ? mu : 1.0));
    for (int64_t i = 0; i < n; ++i) out[i] = param[i] - scale * state.m[static_cast<size_t>(i)];
    return;
  }
  if (state.step == 0 || state.m.size() != static_cast<size_t>(n)) {
    std::copy(param, param + n, out);
    return;
  }
  const auto t = static_cast<double>(state.step + 1);
  const double lr = hyper.lr * weight.factor();
  const auto a = static_cast<float>(lr * hyper.beta1 / (1.0 - std::pow(hyper.beta1, t)));
  const auto b = static_cast<float>(hyper.beta2 / (1.0 - std::pow(hyper.beta2, t)));
  const auto eps = static_cast<float>(hyper.eps);
  for (int64_t i = 0; i < n; ++i) {
    const auto j = static_cast<size_t>(i);
    out[i] = param[i] - a * state.m[j] / (std::sqrt(b * state.v[j]) + eps);
  }
}

}  // namespace hemiola::ps
