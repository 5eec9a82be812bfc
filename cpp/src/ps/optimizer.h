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

// How the servers apply a push that is `tau` versions stale (the asynchronous
// modes; bsp's pushes are never stale, and get the defaults: torch's step).
// SGD: buf' = momentum * momentum_scale * buf + grad_scale * (g + wd * w),
// step lr * lr_scale * buf'. Adam/AdamW: the step's learning rate is scaled
// by factor() (their step is normalised by the second moment, which a
// weighted gradient would skew).
struct PushWeight {
  double lr_scale = 1.0;
  double grad_scale = 1.0;
  double momentum_scale = 1.0;
  // The staleness rule's factor, wherever it is applied.
  double factor() const { return lr_scale * grad_scale; }
};

// The weight of a push `tau` versions stale (a negative tau counts as 0), with
// f the staleness rule's factor (staleness_factor):
//   compensate_momentum: grad_scale f and momentum_scale 1 / (1 + tau). The
//     stale gradient's whole influence shrinks by f, and so does what the
//     momentum carries on. Asynchrony acts as momentum of its own (a stale
//     gradient keeps pushing in an old direction; Mitliagkas et al.,
//     "Asynchrony begets momentum", 2016), and torch's 0.9 on top of it
//     diverges at learning rates where bsp is stable.
//   otherwise: lr_scale f (staleness-aware ASGD, Zhang et al., IJCAI'16).
//     Only the push's own step shrinks; the buffer keeps the stale gradient
//     at full weight for the steps after it.
PushWeight push_weight(StalenessRule rule, int64_t tau, bool compensate_momentum);

// One step of `state.kind` on `param` (n elements) with gradient `grad`,
// weighted by `weight`.
void optimizer_step(OptimizerState& state, float* param, const float* grad, int64_t n,
                    const Hyper& hyper, const PushWeight& weight);

// The parameters after the next step if its gradient were zero (and without
// weight decay): `out` = `param` minus the step that momentum alone takes with
// `weight`, without changing `state`. An eager pull is answered before the
// requester's own push arrives: the requester adds its gradient's share of
// that push's step, the server sends this, the rest of it. With momentum 0.9
// the momentum's share is several times the gradient's.
// SGD: lr * lr_scale * m * buf (Nesterov: m^2), m = momentum * momentum_scale;
// Adam/AdamW: the bias-corrected step at lr * factor() with m and v decayed
// once (beta1 * m, beta2 * v).
void momentum_share_removed(const OptimizerState& state, const float* param, float* out,
                            int64_t n, const Hyper& hyper, const PushWeight& weight);

}  // namespace hemiola::ps
