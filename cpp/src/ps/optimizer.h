// The server-side optimizers: torch.optim's SGD, Adam and AdamW update rules on
// one float32 shard, with the same formulas (and order of operations) as
// torch's single-tensor implementations, so a synchronous parameter server
// matches all-reduce training to float tolerance.
#pragma once

#include <cstdint>
#include <vector>

#include "hemiola/ps.h"

namespace hemiola::ps {

struct OptimizerState {
  OptimizerKind kind = OptimizerKind::kSgd;
  int64_t step = 0;           // Adam/AdamW bias correction
  bool has_momentum = false;  // SGD: the buffer exists (torch creates it on the first step)
  std::vector<float> m;       // SGD momentum buffer, or Adam's first moment
  std::vector<float> v;       // Adam's second moment
};

// One step of `state.kind` on `param` (n elements) with gradient `grad`,
// taking the learning rate as hyper.lr * lr_factor.
void optimizer_step(OptimizerState& state, float* param, const float* grad, int64_t n,
                    const Hyper& hyper, double lr_factor);

// The parameters after the next step if its gradient were zero (and without
// weight decay): `out` = `param` minus the step that momentum alone takes, at
// hyper.lr * lr_factor, without changing `state`. An eager pull is answered
// before the requester's own push arrives: the requester adds its gradient's
// share of that push's step, the server sends this, the rest of it. With
// momentum 0.9 the momentum's share is about nine times the gradient's.
// SGD: lr * momentum * buf (Nesterov: lr * momentum^2 * buf); Adam/AdamW: the
// bias-corrected step with m and v decayed once (beta1 * m, beta2 * v).
void momentum_share_removed(const OptimizerState& state, const float* param, float* out,
                            int64_t n, const Hyper& hyper, double lr_factor);

}  // namespace hemiola::ps
