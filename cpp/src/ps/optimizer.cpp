#include "ps/optimizer.h"

#include <cmath>

#include "hemiola/status.h"

namespace hemiola::ps {

namespace {

void sgd_step(OptimizerState& s, float* p, const float* g, int64_t n, const Hyper& h, double lr) {
  const float wd = static_cast<float>(h.weight_decay);
  const float mu = static_cast<float>(h.momentum);
  const float damp = 1.0f - static_cast<float>(h.dampening);
  const float step = static_cast<float>(lr);
  if (h.momentum != 0.0 && !s.has_momentum) {
    s.m.assign(static_cast<size_t>(n), 0.0f);
  }
  const bool first = h.momentum != 0.0 && !s.has_momentum;
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i];
    if (wd != 0.0f) d += wd * p[i];
    if (h.momentum != 0.0) {
      // torch: the buffer starts as a copy of the first (decayed) gradient.
      float& buf = s.m[static_cast<size_t>(i)];
      buf = first ? d : buf * mu + damp * d;
      d = h.nesterov ? d + mu * buf : buf;
    }
    p[i] -= step * d;
  }
  if (h.momentum != 0.0) s.has_momentum = true;
}

void adam_step(OptimizerState& s, float* p, const float* g, int64_t n, const Hyper& h, double lr,
               bool decoupled) {
  if (s.m.size() != static_cast<size_t>(n)) {
    s.m.assign(static_cast<size_t>(n), 0.0f);
    s.v.assign(static_cast<size_t>(n), 0.0f);
  }
  s.step += 1;
  const double bias1 = 1.0 - std::pow(h.beta1, static_cast<double>(s.step));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(s.step));
  const float step_size = static_cast<float>(lr / bias1);
  const float bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  const float b1 = static_cast<float>(1.0 - h.beta1);
  const float beta2 = static_cast<float>(h.beta2);
  const float b2 = static_cast<float>(1.0 - h.beta2);
  const float eps = static_cast<float>(h.eps);
  const float wd = static_cast<float>(h.weight_decay);
  const float decay = static_cast<float>(1.0 - lr * h.weight_decay);
  for (int64_t i = 0; i < n; ++i) {
    float grad = g[i];
    if (decoupled) {
      if (wd != 0.0f) p[i] *= decay;
    } else if (wd != 0.0f) {
      grad += wd * p[i];
    }
    float& m = s.m[static_cast<size_t>(i)];
    float& v = s.v[static_cast<size_t>(i)];
    m += (grad - m) * b1;  // torch: lerp
    v = v * beta2 + b2 * grad * grad;
    const float denom = std::sqrt(v) / bias2_sqrt + eps;
    p[i] -= step_size * (m / denom);
  }
}

}  // namespace

void optimizer_step(OptimizerState& state, float* param, const float* grad, int64_t n,
                    const Hyper& hyper, double lr_factor) {
  const double lr = hyper.lr * lr_factor;
  switch (state.kind) {
    case OptimizerKind::kSgd: sgd_step(state, param, grad, n, hyper, lr); return;
    case OptimizerKind::kAdam: adam_step(state, param, grad, n, hyper, lr, false); return;
    case OptimizerKind::kAdamW: adam_step(state, param, grad, n, hyper, lr, true); return;
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown optimizer kind ",
                static_cast<int>(state.kind));
}

}  // namespace hemiola::ps
