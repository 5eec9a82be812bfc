// The engine's optimizer (hemiola/optimizer.h) from C++: torch's formulas on
// values small enough to check by hand, commit semantics, and refusals.
// tests/python/test_native_optimizer.py compares it with torch.optim itself.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/dtype_math.h"
#include "hemiola/optimizer.h"
#include "hemiola/status.h"

namespace hemiola {
namespace {

const Device kCpu{};

TEST(Optimizer, SgdWithMomentumFollowsTorch) {
  std::vector<float> p{1.0f, -2.0f}, buf(2, 0.0f);
  const std::vector<float> g{0.5f, 1.0f};
  SgdHyper h;
  h.lr = 0.1;
  h.momentum = 0.9;
  h.first_step = true;
  sgd_step(SgdTensors{p.data(), p.data(), buf.data(), g.data()}, 2, DType::kFloat32, kCpu, h,
           true);
  EXPECT_FLOAT_EQ(buf[0], 0.5f);  // buf = grad on the first step
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * 0.5f);
  h.first_step = false;
  sgd_step(SgdTensors{p.data(), p.data(), buf.data(), g.data()}, 2, DType::kFloat32, kCpu, h,
           true);
  EXPECT_FLOAT_EQ(buf[1], 0.9f * 1.0f + 1.0f);
  EXPECT_FLOAT_EQ(p[1], -2.0f - 0.1f * 1.0f - 0.1f * 1.9f);
}

TEST(Optimizer, AnUncommittedStepWritesOnlyTheLiveParameters) {
  std::vector<float> shadow{1.0f}, live{42.0f}, buf{0.25f};
  const std::vector<float> g{1.0f};
  SgdHyper h;
  h.lr = 0.5;
  h.momentum = 0.5;
  sgd_step(SgdTensors{live.data(), shadow.data(), buf.data(), g.data()}, 1, DType::kFloat32,
           kCpu, h, false);
  EXPECT_FLOAT_EQ(shadow[0], 1.0f);
  EXPECT_FLOAT_EQ(buf[0], 0.25f);
  EXPECT_FLOAT_EQ(live[0], 1.0f - 0.5f * (0.5f * 0.25f + 1.0f));
}

TEST(Optimizer, AdamFirstStepMovesByTheLearningRate) {
  // After one step m/sqrt(v) (bias-corrected) is sign(g): |step| = lr.
  std::vector<uint16_t> p{float_to_bf16(1.0f), float_to_bf16(1.0f)};
  std::vector<uint16_t> m(2, 0), v(2, 0), vmax(2, 0);
  const std::vector<uint16_t> g{float_to_bf16(3.0f), float_to_bf16(-0.5f)};
  AdamHyper h;
  h.lr = 0.125;
  h.amsgrad = true;
  adam_step(AdamTensors{p.data(), p.data(), m.data(), v.data(), g.data(), vmax.data()}, 2,
            DType::kBFloat16, kCpu, h, true);
  EXPECT_FLOAT_EQ(bf16_to_float(p[0]), 0.875f);
  EXPECT_FLOAT_EQ(bf16_to_float(p[1]), 1.125f);
  EXPECT_EQ(vmax, v);
}

TEST(Optimizer, RefusesWhatTorchRefuses) {
  std::vector<float> x(4, 0.0f);
  SgdHyper h;
  h.nesterov = true;
  EXPECT_THROW(sgd_step(SgdTensors{x.data(), x.data(), x.data(), x.data()}, 4, DType::kFloat32,
                        kCpu, h, true),
               Error);
  AdamHyper a;
  a.amsgrad = true;  // without a max_exp_avg_sq buffer
  EXPECT_THROW(adam_step(AdamTensors{x.data(), x.data(), x.data(), x.data(), x.data()}, 4,
                         DType::kFloat32, kCpu, a, true),
               Error);
  a.amsgrad = false;
  EXPECT_THROW(adam_step(AdamTensors{x.data(), x.data(), x.data(), x.data(), x.data()}, 4,
                         DType::kInt32, kCpu, a, true),
               Error);
}

}  // namespace
}  // namespace hemiola
