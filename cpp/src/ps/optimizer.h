// The server-side optimizers: torch.optim's SGD, Adam and AdamW update rules on
// one float32 shard, with the same formulas (and order of operations) as
// torch's single-tensor implementations, so a synchronous parameter server
// matches all-reduce training to float tolerance.
#pragma once

#include <cstdint>
#include <string>
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
// Adam/AdamW: the step's learning rate is scaled by `factor` (their step is
// normalised by the second moment, which a weighted gradient would skew).
// SGD: see SgdPush, which every SGD step and share below goes through.
struct PushWeight {
  double factor = 1.0;  // the staleness rule's f
  double lr_scale = 1.0;
  double grad_scale = 1.0;
  double momentum_scale = 1.0;
  // MomentumRule::kRescaled: the N workers whose round the pushes spread
  // bsp's momentum over (0: not rescaled).
  int rescale_workers = 0;
};

// The weight of a push `tau` versions stale (a negative tau counts as 0) from
// one of `num_workers` workers, with f the staleness rule's factor:
//   kNone: lr_scale f (staleness-aware ASGD, Zhang et al., IJCAI'16). Only
//     the push's own step shrinks; the buffer keeps the stale gradient at full
//     weight for the steps after it.
//   kCompensated: grad_scale f and momentum_scale 1 / (1 + tau). The stale
//     gradient's whole influence shrinks by f, and so does what the momentum
//     carries on (asynchrony acts as momentum of its own: Mitliagkas et al.,
//     "Asynchrony begets momentum", 2016).
//   kRescaled: grad_scale min(1, N f) and rescale_workers N (SgdPush).
PushWeight push_weight(StalenessRule rule, MomentumRule momentum_rule, int64_t tau,
                       int num_workers);

// One SGD push as torch's step would take it: buf' = momentum * buf +
// grad_scale * (1 - dampening) * (g + wd * w), step lr * buf' (Nesterov:
// lr * (grad_scale * (g + wd * w) + momentum * buf')).
struct SgdPush {
  double lr = 0.0;
  double momentum = 0.0;
  double grad_scale = 1.0;
};

// `hyper` weighted by `weight`. Rescaled over N workers (m = hyper.momentum):
// momentum m^(1/N), so N pushes decay the buffer as one bsp round does, and
// grad_scale times (1 - m^(1/N)) / (N (1 - m)), so each gradient moves the
// parameters as far in all (lr (1 - dampening) / (N (1 - m))) as in bsp,
// where it is one of N averaged into a round (1/N without momentum).
SgdPush sgd_push(const OptimizerHyper& hyper, const PushWeight& weight);

// One step of `state.kind` on `param` (n elements) with gradient `grad`,
// weighted by `weight`.
void optimizer_step(OptimizerState& state, float* param, const float* grad, int64_t n,
                    const OptimizerHyper& hyper, const PushWeight& weight);

// The parameters after the next step if its gradient were zero (and without
// weight decay): `out` = `param` minus the step that momentum alone takes with
// `weight`, without changing `state`. An eager pull is answered before the
// requester's own push arrives: the requester adds its gradient's share of
// that push's step, the server sends this, the rest of it. With momentum 0.9
// the momentum's share is several times the gradient's.
// SGD: lr * m * buf (Nesterov: m^2), lr and m from sgd_push;
// Adam/AdamW: the bias-corrected step at lr * factor with m and v decayed
// once (beta1 * m, beta2 * v).
void momentum_share_removed(const OptimizerState& state, const float* param, float* out,
                            int64_t n, const OptimizerHyper& hyper, const PushWeight& weight);

// Empty when `hyper` is a setting `kind` can step with (what torch.optim
// accepts, and finite); otherwise which value is not, e.g. "an invalid
// learning rate (lr nan)". Servers check every pushed setting with it, so a
// bad value is refused naming its worker instead of failing inside a step.
std::string hyper_problem(OptimizerKind kind, const OptimizerHyper& hyper);

// Empty when `a` and `b` step `kind` alike; otherwise the settings that
// differ, naming whose they are: "worker 1 (rank 2) has lr 0.5, worker 0
// (rank 1) lr 0.05".
std::string hyper_mismatch(OptimizerKind kind, const OptimizerHyper& a, const std::string& who_a,
                           const OptimizerHyper& b, const std::string& who_b);

// Empty when the n values are finite; else which one (counted from `first`) is not.
std::string first_non_finite(const float* values, int64_t n, int64_t first = 0);

}  // namespace hemiola::ps
