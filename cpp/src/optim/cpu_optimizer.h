// The CPU loops behind hemiola/optimizer.h (arguments already checked).
#pragma once

#include <cstdint>

#include "hemiola/optimizer.h"

namespace hemiola::optim {

void cpu_sgd_step(const SgdTensors& t, std::int64_t numel, DType dtype, const SgdHyper& hyper,
                  bool commit);
void cpu_adam_step(const AdamTensors& t, std::int64_t numel, DType dtype, const AdamHyper& hyper,
                   bool commit);

}  // namespace hemiola::optim
