#include <gtest/gtest.h>

#include <cmath>

#include "engine/dtype_math.h"

namespace hemiola {
namespace {

TEST(DtypeMath, Fp16RoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(f))));
      continue;
    }
    ASSERT_EQ(float_to_fp16(f), h) << "fp16 bits " << h << " -> " << f;
  }
}

TEST(DtypeMath, Fp16RoundsToNearestEven) {
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + 1.0f / 2048)), 1.0f);  // tie -> even
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
  EXPECT_EQ(fp16_to_float(float_to_fp16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_to_float(float_to_fp16(65520.0f))));
  EXPECT_EQ(fp16_to_float(float_to_fp16(5.9604645e-8f)), 5.9604645e-8f);  // smallest subnormal
  EXPECT_EQ(fp16_to_float(float_to_fp16(2.0e-8f)), 0.0f);
}

TEST(DtypeMath, Bf16RoundTripsAndRounds) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16(f), h);
  }
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);  // tie -> even
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3.0f / 256)), 1.0f + 2.0f / 128);
}

TEST(DtypeMath, SumAndScaleEveryFloatDtype) {
  float a32[3] = {1, 2, 3}, b32[3] = {4, 5, 6};
  sum_into(DType::kFloat32, a32, a32, b32, 3);
  EXPECT_EQ(a32[2], 9.0f);
  scale_in_place(DType::kFloat32, a32, 3, 0.5);
  EXPECT_EQ(a32[0], 2.5f);
  uint16_t h[2] = {float_to_fp16(1.5f), float_to_fp16(-2.0f)};
  uint16_t g[2] = {float_to_fp16(0.25f), float_to_fp16(4.0f)};
  sum_into(DType::kFloat16, h, h, g, 2);
  EXPECT_EQ(fp16_to_float(h[0]), 1.75f);
  EXPECT_EQ(fp16_to_float(h[1]), 2.0f);
  uint16_t bf[1] = {float_to_bf16(3.0f)};
  scale_in_place(DType::kBFloat16, bf, 1, 1.0 / 3.0);
  EXPECT_FLOAT_EQ(bf16_to_float(bf[0]), 1.0f);
  EXPECT_THROW(scale_in_place(DType::kInt64, nullptr, 0, 0.5), std::exception);
}

}  // namespace
}  // namespace hemiola
