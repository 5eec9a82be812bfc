#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype_math.h"
#include "core/half_cast.h"

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

// The bulk (F16C / vectorised) conversions against the element-wise ones, on
// every float16 and bfloat16 value, random float32 values of every magnitude,
// and the edge cases, bit for bit (NaN payloads aside).
TEST(DtypeMath, BulkHalfConversionsEqualTheElementwiseOnes) {
  std::vector<float> floats;
  for (uint32_t h = 0; h < 65536; ++h) {
    floats.push_back(fp16_to_float(static_cast<uint16_t>(h)));
    floats.push_back(bf16_to_float(static_cast<uint16_t>(h)));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, sizeof f);
    floats.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 65504.0f, 65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f, 1e38f}) {
    floats.push_back(f);
  }
  const size_t n = floats.size();
  auto same = [](uint16_t a, uint16_t b, bool fp16) {
    const float fa = fp16 ? fp16_to_float(a) : bf16_to_float(a);
    const float fb = fp16 ? fp16_to_float(b) : bf16_to_float(b);
    return a == b || (std::isnan(fa) && std::isnan(fb));
  };
  for (const DType half : {DType::kFloat16, DType::kBFloat16}) {
    const bool fp16 = half == DType::kFloat16;
    auto to = [&](float f) { return fp16 ? float_to_fp16(f) : float_to_bf16(f); };
    auto from = [&](uint16_t h) { return fp16 ? fp16_to_float(h) : bf16_to_float(h); };
    for (const float divisor : {1.0f, 2.0f, 3.0f}) {
      std::vector<uint16_t> bulk(n);
      floats_to_halves(half, floats.data(), bulk.data(), n, divisor);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = to(floats[i]);
        const uint16_t expected = divisor == 1.0f ? h : to(from(h) / divisor);
        ASSERT_TRUE(same(bulk[i], expected, fp16))
            << dtype_name(half) << " " << floats[i] << " / " << divisor;
      }
    }
    std::vector<uint16_t> a(n), b(n), sum(n);
    floats_to_halves(half, floats.data(), a.data(), n, 1.0f);
    std::reverse_copy(a.begin(), a.end(), b.begin());
    sum_halves(half, sum.data(), a.data(), b.data(), n);
    std::vector<float> back(n);
    halves_to_floats(half, a.data(), back.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(same(sum[i], to(from(a[i]) + from(b[i])), fp16)) << i;
      const float f = from(a[i]);
      ASSERT_TRUE(back[i] == f || (std::isnan(back[i]) && std::isnan(f))) << i;
    }
  }
}

}  // namespace
}  // namespace hemiola
