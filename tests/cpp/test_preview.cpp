// The preview (engine/preview.h, ReducerOptions::preview): its codes are
// summed exactly, the estimates' mean over the ranks is the average, each
// estimate is within the coding error of the average, and a rank's own
// gradient survives where the codes cannot carry it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/codec/preview.h"
#include "engine/reducer/reducer_impl.h"
#include "hemiola/hemiola.h"
#include "run_ranks.h"

namespace hemiola {
namespace {

using test::run_ranks;

TEST(PreviewCodec, EstimatesAverageToTheAverageAndStayWithinTheCodingError) {
  const int world = 4;
  const int levels = preview_levels(world);
  ASSERT_EQ(levels, 31);  // 4 * 31 <= 127: the sum fits an int8
  const size_t n = 1000;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> g(world, std::vector<float>(n));
  std::vector<float> average(n, 0.0f);
  for (auto& rank : g) {
    for (size_t i = 0; i < n; ++i) {
      rank[i] = normal(rng);
      average[i] += rank[i] / world;
    }
  }
  // Scales from the average itself (the reducer takes an earlier one's).
  std::vector<float> scales((n + kPreviewBlock - 1) / kPreviewBlock);
  preview_scales(DType::kFloat32, average.data(), n, world, scales.data());
  for (float s : scales) ASSERT_GT(s, 0.0f);
  std::vector<std::vector<int8_t>> codes(world, std::vector<int8_t>(n));
  std::vector<std::vector<float>> estimate(world, std::vector<float>(n));
  std::vector<uint8_t> sums(n, 0);
  for (int r = 0; r < world; ++r) {
    // Coded in two pieces, as two tensors of one bucket would be, the cut
    // inside a block.
    const size_t cut = 300;
    preview_encode(DType::kFloat32, g[r].data(), 0, cut, scales.data(), levels, codes[r].data(),
                   estimate[r].data());
    preview_encode(DType::kFloat32, g[r].data() + cut, cut, n - cut, scales.data(), levels,
                   codes[r].data() + cut, estimate[r].data() + cut);
    for (size_t i = 0; i < n; ++i) sums[i] = static_cast<uint8_t>(sums[i] + codes[r][i]);
  }
  for (int r = 0; r < world; ++r) {
    preview_decode(DType::kFloat32, reinterpret_cast<const int8_t*>(sums.data()), 0, n,
                   scales.data(), world, estimate[r].data());
  }
  size_t clipped = 0;
  for (size_t i = 0; i < n; ++i) {
    double mean = 0.0;
    bool any_clipped = false;
    for (int r = 0; r < world; ++r) {
      mean += estimate[r][i] / world;
      any_clipped |= std::abs(codes[r][i]) == levels;
    }
    EXPECT_NEAR(mean, average[i], 1e-5) << i;  // the coding errors cancel
    clipped += any_clipped;
    if (!any_clipped) {
      // Each estimate is off by its own rounding error minus the mean one.
      const float scale = scales[i / kPreviewBlock];
      for (int r = 0; r < world; ++r) EXPECT_LE(std::abs(estimate[r][i] - average[i]), scale);
    }
  }
  // Each rank's value is the noise (rms 1), and the average's rms is 1/2:
  // codes span preview_range(4) = 10 of the average's rms, 5 of a rank's,
  // so hardly any value clips (a span of 3 clipped a rank in 44% of the
  // elements here).
  EXPECT_LT(clipped, n / 100);
}

TEST(PreviewCodec, TheSpanGrowsWithTheRootOfTheWorld) {
  EXPECT_DOUBLE_EQ(preview_range(4), 10.0);
  EXPECT_NEAR(preview_range(16), 20.0, 1e-12);
  // One block whose average has rms 2: scale = range * 2 / levels.
  std::vector<float> average(kPreviewBlock, 2.0f);
  for (int world : {1, 2, 4, 8, 127}) {
    float scale = 0.0f;
    preview_scales(DType::kFloat32, average.data(), average.size(), world, &scale);
    EXPECT_NEAR(scale, preview_range(world) * 2.0 / preview_levels(world), 1e-5) << world;
  }
}

TEST(PreviewCodec, WithoutAScaleOrAFiniteValueTheEstimateIsTheOwnGradient) {
  const float g[3] = {0.5f, std::nanf(""), -2.0f};
  int8_t codes[3];
  float estimate[3];
  const float none[1] = {0.0f};
  preview_encode(DType::kFloat32, g, 0, 3, none, 31, codes, estimate);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(estimate[0], 0.5f);
  EXPECT_EQ(estimate[2], -2.0f);
  const float tenth[1] = {0.1f};
  preview_encode(DType::kFloat32, g, 0, 3, tenth, 31, codes, estimate);
  EXPECT_EQ(codes[0], 5);
  EXPECT_EQ(codes[1], 0);
  EXPECT_TRUE(std::isnan(estimate[1]));
  EXPECT_EQ(codes[2], -20);
  float scale = -1.0f;
  preview_scales(DType::kFloat32, g, 3, 4, &scale);
  EXPECT_EQ(scale, 0.0f);  // NaN in the average: no scale
  EXPECT_EQ(preview_levels(128), 0);
}

TEST(Reducer, PreviewArrivesOnItsLaneAndCentresOnTheOwnGradient) {
  const int world = 3;
  const size_t n = 2000;
  run_ranks(world, [&](Engine& e) {
    std::vector<GradSpec> specs = {{DType::kFloat32, n, "w"}, {DType::kBFloat16, 64, "b"},
                                   {DType::kFloat32, 10, "unused"}};
    ReducerOptions options;
    options.in_flight = 1;
    options.preview = true;
    options.track_usage = true;
    options.fusion_bytes = options.first_bucket_bytes = 4096;
    auto reducer = e.make_reducer(specs, options);
    ReducerImpl& lanes = ReducerAccess::impl(*reducer);  // per-bucket previews are internal
    std::vector<float> w(n), w_all(n);
    std::vector<uint16_t> b(64, 0x3f80);  // bfloat16 1.0 on every rank
    double total_error = 0.0, total_norm = 0.0;  // over the previews, as preview_error() sums
    for (uint64_t k = 0; k < 6; ++k) {
      // Rank r's gradient, and the average of all ranks' (recomputed here).
      for (size_t i = 0; i < n; ++i) {
        auto value = [&](int r) {
          return std::sin(0.01f * i * (k + 1)) + 0.3f * std::cos(1.7f * i + r + 3.0f * k);
        };
        w[i] = value(e.rank());
        w_all[i] = 0.0f;
        for (int r = 0; r < world; ++r) w_all[i] += value(r) / world;
      }
      reducer->mark_ready(0, w.data(), nullptr);
      reducer->mark_ready(1, b.data(), nullptr);
      reducer->mark_unused(2);
      const int64_t it = reducer->finish_marking();
      ASSERT_EQ(it, static_cast<int64_t>(k));
      const auto buckets = reducer->buckets();
      for (size_t bucket = 0; bucket < buckets.size(); ++bucket) {
        lanes.wait_preview(k, bucket);
        // From the second iteration on (the scales come from the previous one).
        EXPECT_EQ(lanes.preview_done(k, bucket), k >= 1) << "iteration " << k;
      }
      if (k >= 1) {
        const float* estimate = static_cast<const float*>(lanes.preview(k, 0).data);
        double error = 0.0, own = 0.0;
        for (size_t i = 0; i < n; ++i) {
          error += std::pow(estimate[i] - w_all[i], 2);
          own += std::pow(w[i] - w_all[i], 2);
        }
        // Closer to the average than the rank's own gradient. Here a rank's
        // deviation is small against the average (0.065 per element, the
        // average's rms 0.7), so the codes' step, preview_range(3) = 8.7 rms
        // / 42 = 0.15, leaves a rounding error of about 0.035 per element
        // (the noise-dominated case, where the preview gains most, is the
        // codec test's).
        EXPECT_LT(std::sqrt(error), 0.7 * std::sqrt(own)) << "iteration " << k;
        total_error += error;  // "b" adds nothing (its estimate is exact), "unused" zeros
        for (size_t i = 0; i < n; ++i) total_norm += std::pow(w_all[i], 2);
        total_norm += 64.0;
        const uint16_t* eb = static_cast<const uint16_t*>(lanes.preview(k, 1).data);
        EXPECT_EQ(eb[5], 0x3f80);  // equal on every rank: the estimate is the value
      }
      reducer->wait(k);
      // The full reduction is untouched by the preview.
      const float* full = static_cast<const float*>(reducer->result(k, 0).data);
      for (size_t i = 0; i < n; i += 97) EXPECT_NEAR(full[i], w_all[i], 1e-5);
    }
    const double expected = std::sqrt(total_error / total_norm);
    EXPECT_GT(expected, 1e-3);  // the codes do not resolve everything: the check can fail
    EXPECT_NEAR(reducer->preview_error(), expected, 1e-3 * expected);
  });
}

TEST(Reducer, PreviewIsRefusedWhereItCannotWork) {
  run_ranks(1, [&](Engine& e) {
    ReducerOptions options;
    options.preview = true;
    options.device = Device{DeviceType::kCUDA, 0};
    EXPECT_THROW(e.make_reducer({{DType::kFloat32, 4, "w"}}, options), Error);
  });
}

}  // namespace
}  // namespace hemiola
