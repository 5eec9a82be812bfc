// The parameter server's optimizer: the engine's own (hemiola/optimizer.h),
// committing in place on the server's float32 shards.
#include "ps/optimizer.h"

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

}  // namespace hemiola::ps
