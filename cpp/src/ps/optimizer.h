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

}  // namespace hemiola::ps
