// Wire compression (ReducerOptions::compression) through a real reducer:
// N ranks as threads over loopback Gloo, results against references computed
// here from every rank's gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>

#include "core/dtype_math.h"
#include "engine/codec/codings.h"
#include "hemiola/hemiola.h"
#include "run_ranks.h"

namespace hemiola {
namespace {

using test::run_ranks;

// Rank r's gradient of tensor i in iteration `it`: a few orders of magnitude
// apart across tensors, different on every rank.
std::vector<float> gradient(int rank, size_t i, size_t n, int it) {
  std::mt19937 rng(static_cast<unsigned>(1000 * rank + 10 * i + it));
  std::normal_distribution<float> normal(0.0f, std::pow(10.0f, static_cast<float>(i % 3) - 2.0f));
  std::vector<float> g(n);
  for (auto& x : g) x = normal(rng);
  return g;
}

std::vector<GradSpec> specs_of(const std::vector<size_t>& numels) {
  std::vector<GradSpec> specs;
  for (size_t i = 0; i < numels.size(); ++i) {
    specs.push_back({DType::kFloat32, numels[i], "t" + std::to_string(i)});
  }
  return specs;
}

// Reducer options with `compression`, the others at their defaults.
ReducerOptions compressed(Compression compression) {
  ReducerOptions options;
  options.compression = compression;
  return options;
}

class HalfWire : public ::testing::TestWithParam<std::tuple<Compression, int>> {};

TEST_P(HalfWire, IsTheCastPreDividedSumCastBack) {
  const auto [compression, world] = GetParam();
  const bool fp16 = compression == Compression::kFp16;
  auto to_half = [&](float f) { return fp16 ? float_to_fp16(f) : float_to_bf16(f); };
  auto to_float = [&](uint16_t h) { return fp16 ? fp16_to_float(h) : bf16_to_float(h); };
  const std::vector<size_t> numels = {3000, 17, 600};
  const auto specs = specs_of(numels);
  std::vector<std::vector<std::vector<float>>> results(world);
  run_ranks(world, [&](Engine& e) {
    ReducerOptions options = compressed(compression);
    options.fusion_bytes = options.first_bucket_bytes = 4096;
    auto reducer = e.make_reducer(specs, options);
    std::vector<std::vector<float>> grads;
    for (size_t i = 0; i < specs.size(); ++i) grads.push_back(gradient(e.rank(), i, numels[i], 0));
    for (size_t i = 0; i < specs.size(); ++i) {
      reducer->mark_ready(i, TensorRef{grads[i].data(), DType::kFloat32, numels[i], {}});
    }
    reducer->wait();
    results[e.rank()] = grads;
  });
  for (size_t i = 0; i < numels.size(); ++i) {
    for (size_t j = 0; j < numels[i]; ++j) {
      // Each rank's half, divided in half precision, summed in half precision.
      float sum = 0.0f;
      for (int r = 0; r < world; ++r) {
        const float mine = to_float(to_half(to_float(to_half(gradient(r, i, numels[i], 0)[j])) /
                                            static_cast<float>(world)));
        sum = r == 0 ? mine : to_float(to_half(sum + mine));
      }
      double exact_sum = 0.0;
      double magnitude = 0.0;  // what the roundings are relative to
      for (int r = 0; r < world; ++r) {
        const float g = gradient(r, i, numels[i], 0)[j];
        exact_sum += g;
        magnitude += std::fabs(g) / world;
      }
      const double exact = exact_sum / world;
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(results[r][i][j], results[0][i][j]) << "ranks differ at " << i << "," << j;
      }
      if (world == 2) {  // two addends: the sum's order cannot differ
        ASSERT_EQ(results[0][i][j], sum) << "tensor " << i << " element " << j;
      }
      // Three roundings (cast, divide, sum) of half an ulp each, and fp16's
      // subnormal spacing (6e-8) near zero.
      const double tolerance = (fp16 ? 2e-3 : 1.6e-2) * magnitude + (fp16 ? 2e-7 : 0.0);
      ASSERT_NEAR(results[0][i][j], exact, tolerance) << "tensor " << i << " element " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Codings, HalfWire,
                         ::testing::Combine(::testing::Values(Compression::kFp16,
                                                              Compression::kBf16),
                                            ::testing::Values(2, 3)));

// int8 and int4: codes in [-L, L] per element, one scale per block
// (engine/codec/block_coding.h): each rank codes its blocks with its own
// scales, the owner of each chunk of blocks averages the decoded values in
// float32 and codes the average again, and every rank decodes the owners'.
class BlockWire : public ::testing::TestWithParam<std::tuple<Compression, int>> {};

// L: 127 for int8, 7 for int4, at any number of ranks.
int levels_of(Compression compression) { return compression == Compression::kInt8 ? 127 : 7; }

// Codes the values v[first, last) with one scale, s = max |v| / L, leaving
// what the coding dropped in v; returns the decoded values s * q.
std::vector<float> code_block(std::vector<float>& v, size_t first, size_t last, int levels) {
  float m = 0.0f;
  for (size_t k = first; k < last; ++k) m = std::max(m, std::fabs(v[k]));
  const float s = m / static_cast<float>(levels);
  std::vector<float> decoded;
  for (size_t k = first; k < last; ++k) {
    const float q = s > 0.0f ? std::nearbyint(std::clamp(v[k] * (1.0f / s), -1.0f * levels,
                                                         1.0f * levels))
                             : 0.0f;
    v[k] -= s * q;
    decoded.push_back(s * q);
  }
  return decoded;
}

// The coding written out over the ranks' gradients, iteration by iteration,
// with both residuals carried across iterations.
TEST_P(BlockWire, AveragesWithErrorFeedbackCarriedAcrossIterations) {
  const auto [compression, world] = GetParam();
  const std::vector<size_t> numels = {700, 5, 300};
  const auto specs = specs_of(numels);
  const int iterations = 4;
  std::vector<std::vector<std::vector<std::vector<float>>>> results(
      world, std::vector<std::vector<std::vector<float>>>(iterations));
  std::vector<std::vector<std::vector<float>>> residuals(world);
  run_ranks(world, [&](Engine& e) {
    ReducerOptions options = compressed(compression);
    options.fusion_bytes = options.first_bucket_bytes = 2048;
    auto reducer = e.make_reducer(specs, options);
    for (int it = 0; it < iterations; ++it) {
      std::vector<std::vector<float>> grads;
      for (size_t i = 0; i < specs.size(); ++i) {
        grads.push_back(gradient(e.rank(), i, numels[i], it));
      }
      for (size_t i = specs.size(); i-- > 0;) {
        reducer->mark_ready(i, TensorRef{grads[i].data(), DType::kFloat32, numels[i], {}});
      }
      reducer->wait();
      results[e.rank()][it] = grads;
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorRef r = reducer->residual(i);
      const float* data = static_cast<const float*>(r.data);
      residuals[e.rank()].emplace_back(data, data + r.numel);
    }
  });
  // The plan (reverse order, 2048-byte caps): one bucket {t2, t1, t0} of
  // 1005 elements: 4 blocks (the last of 237, an odd count: int4's last byte
  // holds one code), owned in chunks of ceil(4 / world) blocks.
  const std::vector<size_t> order = {2, 1, 0};
  const int levels = levels_of(compression);
  const size_t n = 1005;
  const size_t blocks = (n + kInt8Block - 1) / kInt8Block;
  const size_t per_rank = (blocks + world - 1) / world;
  std::vector<std::vector<float>> e1(world, std::vector<float>(n, 0.0f));  // per rank, packed
  std::vector<float> e2(n, 0.0f);  // the owner's, packed
  for (int it = 0; it < iterations; ++it) {
    std::vector<std::vector<float>> v(world);
    for (int r = 0; r < world; ++r) {
      for (size_t i : order) {
        const auto g = gradient(r, i, numels[i], it);
        for (size_t j = 0; j < numels[i]; ++j) v[r].push_back(g[j]);
      }
      for (size_t k = 0; k < n; ++k) v[r][k] += e1[r][k];
    }
    std::vector<float> average(n);
    for (size_t blk = 0; blk < blocks; ++blk) {
      const size_t first = blk * kInt8Block;
      const size_t last = std::min(n, first + kInt8Block);
      std::vector<float> sum(last - first, 0.0f);
      for (int r = 0; r < world; ++r) {
        const auto decoded = code_block(v[r], first, last, levels);
        for (size_t k = 0; k < sum.size(); ++k) sum[k] += decoded[k];
      }
      std::vector<float> owned(n, 0.0f);
      for (size_t k = first; k < last; ++k) {
        owned[k] = sum[k - first] * (1.0f / static_cast<float>(world)) + e2[k];
      }
      const auto decoded = code_block(owned, first, last, levels);
      for (size_t k = first; k < last; ++k) {
        average[k] = decoded[k - first];
        e2[k] = owned[k];
      }
    }
    for (int r = 0; r < world; ++r) e1[r] = v[r];
    size_t offset = 0;
    for (size_t i : order) {
      for (size_t j = 0; j < numels[i]; ++j, ++offset) {
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(results[r][it][i][j], average[offset])
              << "rank " << r << " iteration " << it << " tensor " << i << " element " << j;
        }
      }
    }
  }
  // Each rank's residuals: its own coding's, then the owner's where it owns.
  size_t offset = 0;
  for (size_t i : order) {
    for (size_t j = 0; j < numels[i]; ++j, ++offset) {
      const int owner = static_cast<int>(offset / kInt8Block / per_rank);
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(residuals[r][i].size(), 2 * numels[i]);
        EXPECT_EQ(residuals[r][i][j], e1[r][offset]) << "rank " << r << " tensor " << i;
        EXPECT_EQ(residuals[r][i][numels[i] + j], r == owner ? e2[offset] : 0.0f)
            << "rank " << r << " tensor " << i << " element " << j;
      }
    }
  }
  // Error feedback: summed over the iterations, the averages equal the exact
  // averages up to what is still in the residuals (both kinds).
  double drift = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < numels.size(); ++i) {
    std::vector<std::vector<std::vector<float>>> g(iterations);  // per iteration, per rank
    for (int it = 0; it < iterations; ++it) {
      for (int r = 0; r < world; ++r) g[it].push_back(gradient(r, i, numels[i], it));
    }
    for (size_t j = 0; j < numels[i]; ++j) {
      double exact = 0.0;
      double delivered = 0.0;
      double held = 0.0;
      for (int it = 0; it < iterations; ++it) {
        for (int r = 0; r < world; ++r) exact += g[it][r][j] / world;
        delivered += results[0][it][i][j];
      }
      for (int r = 0; r < world; ++r) {
        held += residuals[r][i][j] / world + residuals[r][i][numels[i] + j];
      }
      drift = std::max(drift, std::fabs(exact - delivered - held));
      norm = std::max(norm, std::fabs(exact));
    }
  }
  EXPECT_LT(drift, 1e-5 * norm);
}

// 8 ranks: int4's old coding (codes summed in four bits) refused them.
INSTANTIATE_TEST_SUITE_P(Int8, BlockWire,
                         ::testing::Combine(::testing::Values(Compression::kInt8),
                                            ::testing::Values(1, 2, 3, 8)));
INSTANTIATE_TEST_SUITE_P(Int4, BlockWire,
                         ::testing::Combine(::testing::Values(Compression::kInt4),
                                            ::testing::Values(1, 2, 3, 8)));

// The precision does not fall with the number of ranks: one iteration of
// int8 and int4 (no residual yet) strays from the exact average by at most a
// level of each coding (relative to each block's largest value), at 2 and at
// 16 ranks alike.
TEST(BlockWire, PrecisionDoesNotFallWithTheRanks) {
  for (Compression compression : {Compression::kInt8, Compression::kInt4}) {
    for (int world : {2, 16}) {
      const std::vector<size_t> numels = {2048};
      const auto specs = specs_of(numels);
      std::vector<std::vector<float>> got(world);
      run_ranks(world, [&](Engine& e) {
        auto reducer = e.make_reducer(specs, compressed(compression));
        auto g = gradient(e.rank(), 0, 2048, 0);
        reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat32, 2048, {}});
        reducer->wait();
        got[e.rank()] = g;
      });
      std::vector<std::vector<float>> sent;
      for (int r = 0; r < world; ++r) sent.push_back(gradient(r, 0, 2048, 0));
      double error = 0.0;
      double largest = 0.0;
      for (size_t j = 0; j < 2048; ++j) {
        double exact = 0.0;
        for (int r = 0; r < world; ++r) {
          exact += sent[r][j] / world;
          largest = std::max(largest, double(std::fabs(sent[r][j])));
        }
        error = std::max(error, std::fabs(exact - got[0][j]));
        for (int r = 1; r < world; ++r) ASSERT_EQ(got[r][j], got[0][j]);
      }
      // Each coding rounds by at most half a level: the ranks' values (half a
      // level of each rank's block max, at most `largest`) and the average's.
      const double level = largest / levels_of(compression);
      EXPECT_LE(error, level) << "world " << world;
    }
  }
}

class BlockCoding : public ::testing::TestWithParam<Compression> {};

TEST_P(BlockCoding, ANonFiniteGradientGivesANonFiniteAverageOnEveryRank) {
  const auto specs = specs_of({600});
  run_ranks(2, [&](Engine& e) {
    auto reducer = e.make_reducer(specs, compressed(GetParam()));
    std::vector<float> g(600, 1.0f);
    if (e.rank() == 1) g[300] = std::numeric_limits<float>::infinity();
    reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat32, 600, {}});
    reducer->wait();
    EXPECT_TRUE(std::isnan(g[300]));  // its block (256..511) is NaN everywhere
    EXPECT_TRUE(std::isnan(g[256]));
    EXPECT_FLOAT_EQ(g[0], 1.0f);  // other blocks are untouched by it
    EXPECT_FLOAT_EQ(g[599], 1.0f);
    // The non-finite block's residual is reset, so the next iteration is clean.
    const TensorRef r = reducer->residual(0);
    EXPECT_EQ(static_cast<const float*>(r.data)[300], 0.0f);
    std::fill(g.begin(), g.end(), 2.0f);
    reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat32, 600, {}});
    reducer->wait();
    EXPECT_FLOAT_EQ(g[300], 2.0f);
  });
}

TEST_P(BlockCoding, ABlockOfTinyValuesIsKeptNotMiscoded) {
  const auto specs = specs_of({300});
  run_ranks(1, [&](Engine& e) {
    auto reducer = e.make_reducer(specs, compressed(GetParam()));
    std::vector<float> g(300, 0.0f);
    // Its block's scale (1e-38 / L, L = 127 or 7) has no finite inverse.
    g[0] = 1e-38f;
    reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat32, 300, {}});
    reducer->wait();
    EXPECT_EQ(g[1], 0.0f);  // int8 gave -1e-37 for 1e-37 before the fix
    EXPECT_EQ(g[0], 0.0f);  // not sent this time...
    const TensorRef r = reducer->residual(0);
    EXPECT_EQ(static_cast<const float*>(r.data)[0], 1e-38f);  // ...but kept
    EXPECT_EQ(static_cast<const float*>(r.data)[1], 0.0f);
  });
}

INSTANTIATE_TEST_SUITE_P(Codings, BlockCoding,
                         ::testing::Values(Compression::kInt8, Compression::kInt4));

TEST(Compression, RefusedWhereItCannotWork) {
  const auto specs = specs_of({10});
  run_ranks(1, [&](Engine& e) {
    ReducerOptions options = compressed(Compression::kFp16);
    options.average = false;
    EXPECT_THROW(e.make_reducer(specs, options), Error);
    ReducerOptions plain;
    auto reducer = e.make_reducer(specs, plain);
    EXPECT_THROW(reducer->residual(0), Error);  // no error feedback without int8
  });
}

// The factory's table decides, before anything touches a device, and its
// refusal names what does work on a GPU.
TEST(Compression, ACudaReducerRefusesTheHostOnlyCodings) {
  const auto specs = specs_of({10});
  run_ranks(1, [&](Engine& e) {
    for (Compression c : {Compression::kInt8, Compression::kPowerSgd, Compression::kInt4}) {
      ReducerOptions options = compressed(c);
      options.device = Device{DeviceType::kCUDA, 0};
      try {
        e.make_reducer(specs, options);
        ADD_FAILURE() << "a CUDA reducer accepted a host-only coding";
      } catch (const Error& error) {
        EXPECT_NE(std::string(error.what()).find("a CUDA reducer compresses with fp16 or bf16; "
                                                 "int8, powersgd and int4 are implemented for "
                                                 "CPU reducers only"),
                  std::string::npos)
            << error.what();
      }
    }
  });
}

TEST(Compression, OtherDtypesTravelAsTheyAre) {
  std::vector<GradSpec> specs = {{DType::kFloat64, 100, "d"}};
  run_ranks(2, [&](Engine& e) {
    auto reducer = e.make_reducer(specs, compressed(Compression::kInt8));
    std::vector<double> g(100, 0.1 * (e.rank() + 1) + 1e-12);
    reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat64, 100, {}});
    reducer->wait();
    EXPECT_DOUBLE_EQ(g[7], 0.15 + 1e-12);
  });
}

// PowerSGD through a real reducer. Its invariants rather than a second copy
// of its arithmetic: low rank where it compresses, exact where the average
// itself is low rank, small tensors exactly averaged, nothing lost (error
// feedback), the same on every rank.
class PowerSgdWire : public ::testing::TestWithParam<int> {};

TEST_P(PowerSgdWire, LowRankWithErrorFeedbackAndExactSmallTensors) {
  const int world = GetParam();
  const size_t rows = 48, cols = 40, rank = 2;
  std::vector<GradSpec> specs = {{DType::kFloat32, rows * cols, "w", rows},
                                 {DType::kFloat32, cols, "b", 0},
                                 {DType::kFloat32, 6 * 5, "small", 6}};
  const int iterations = 4;
  // results[rank][iteration][tensor], residuals[rank][tensor] after each iteration
  std::vector<std::vector<std::vector<std::vector<float>>>> results(
      world, std::vector<std::vector<std::vector<float>>>(iterations));
  std::vector<std::vector<std::vector<std::vector<float>>>> residuals(
      world, std::vector<std::vector<std::vector<float>>>(iterations));
  run_ranks(world, [&](Engine& e) {
    ReducerOptions options = compressed(Compression::kPowerSgd);
    options.powersgd_rank = rank;
    options.powersgd_start_iteration = 1;  // iteration 0 travels uncompressed
    auto reducer = e.make_reducer(specs, options);
    for (int it = 0; it < iterations; ++it) {
      std::vector<std::vector<float>> grads;
      for (size_t i = 0; i < specs.size(); ++i) {
        grads.push_back(gradient(e.rank(), i, specs[i].numel, it));
      }
      for (size_t i = 0; i < specs.size(); ++i) {
        reducer->mark_ready(i, TensorRef{grads[i].data(), DType::kFloat32, specs[i].numel, {}});
      }
      reducer->wait();
      results[e.rank()][it] = grads;
      for (size_t i = 0; i < specs.size(); ++i) {
        const TensorRef r = reducer->residual(i);
        const float* d = static_cast<const float*>(r.data);
        residuals[e.rank()][it].emplace_back(d, d + r.numel);
      }
    }
  });
  auto exact_average = [&](size_t i, int it) {
    std::vector<double> avg(specs[i].numel, 0.0);
    for (int r = 0; r < world; ++r) {
      const auto g = gradient(r, i, specs[i].numel, it);
      for (size_t j = 0; j < avg.size(); ++j) avg[j] += g[j] / world;
    }
    return avg;
  };
  for (int it = 0; it < iterations; ++it) {
    for (int r = 1; r < world; ++r) EXPECT_EQ(results[r][it], results[0][it]) << "rank " << r;
    // The bias and the 6x5 matrix (too small to be worth compressing:
    // (6 + 5) * 2 * 2 >= 30) are averaged exactly, every iteration.
    for (size_t i : {size_t{1}, size_t{2}}) {
      const auto avg = exact_average(i, it);
      for (size_t j = 0; j < avg.size(); ++j) {
        ASSERT_NEAR(results[0][it][i][j], avg[j], 1e-6 * (1 + std::fabs(avg[j])));
      }
      EXPECT_TRUE(residuals[0][it][i].empty());
    }
  }
  // Iteration 0 (warm-up) is exact; from iteration 1 the matrix's average is
  // of rank <= 2: every 3x3 minor... checked through the residual instead:
  // nothing is lost. Summed over the ranks, what was sent plus what is kept
  // equals what there was to send.
  for (int it = 1; it < iterations; ++it) {
    double worst = 0.0;
    double scale = 0.0;
    const auto avg = exact_average(0, it);
    for (size_t j = 0; j < avg.size(); ++j) {
      double before = avg[j];
      double after = results[0][it][0][j];
      for (int r = 0; r < world; ++r) {
        if (it > 1) before += residuals[r][it - 1][0][j] / world;
        after += residuals[r][it][0][j] / world;
      }
      worst = std::max(worst, std::fabs(before - after));
      scale = std::max(scale, std::fabs(avg[j]));
    }
    EXPECT_LT(worst, 1e-5 * scale) << "iteration " << it;
  }
  // Low rank: the delivered matrix has rank <= 2, so its rows span at most a
  // 2-dimensional space: Gram-Schmidt over the rows leaves nothing after two.
  for (int it = 1; it < iterations; ++it) {
    std::vector<std::vector<double>> basis;
    double largest_left = 0.0;
    for (size_t i = 0; i < rows; ++i) {
      std::vector<double> v(results[0][it][0].begin() + i * cols,
                            results[0][it][0].begin() + (i + 1) * cols);
      double norm0 = 0.0;
      for (double x : v) norm0 += x * x;
      for (const auto& b : basis) {
        double dot = 0.0;
        for (size_t j = 0; j < cols; ++j) dot += v[j] * b[j];
        for (size_t j = 0; j < cols; ++j) v[j] -= dot * b[j];
      }
      double norm = 0.0;
      for (double x : v) norm += x * x;
      if (basis.size() < rank && norm > 1e-12 * (norm0 + 1e-30)) {
        for (double& x : v) x /= std::sqrt(norm);
        basis.push_back(v);
      } else if (norm0 > 0) {
        largest_left = std::max(largest_left, std::sqrt(norm / norm0));
      }
    }
    EXPECT_EQ(basis.size(), rank);
    EXPECT_LT(largest_left, 1e-3) << "iteration " << it << ": not of rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, PowerSgdWire, ::testing::Values(1, 2, 3));

TEST(PowerSgdWire, AnAverageThatIsItselfLowRankIsRecovered) {
  // Every rank's gradient is U V_r^T with the same U (rank 2): their average
  // is of rank 2 and lies in the span PowerSGD finds, so it comes back whole.
  const size_t rows = 30, cols = 20;
  std::vector<GradSpec> specs = {{DType::kFloat32, rows * cols, "w", rows}};
  std::vector<std::vector<float>> results(2);
  auto grad_of = [&](int rank) {
    std::vector<float> g(rows * cols);
    for (size_t i = 0; i < rows; ++i) {
      for (size_t j = 0; j < cols; ++j) {
        const float u0 = std::sin(0.3f * i), u1 = std::cos(0.7f * i + 1);
        g[i * cols + j] = u0 * (j + rank + 1.0f) + u1 * (0.5f * j * j - rank);
      }
    }
    return g;
  };
  run_ranks(2, [&](Engine& e) {
    ReducerOptions options = compressed(Compression::kPowerSgd);
    options.powersgd_start_iteration = 0;
    auto reducer = e.make_reducer(specs, options);
    auto g = grad_of(e.rank());
    reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat32, g.size(), {}});
    reducer->wait();
    results[e.rank()] = g;
  });
  const auto a = grad_of(0), b = grad_of(1);
  for (size_t j = 0; j < a.size(); ++j) {
    const float avg = (a[j] + b[j]) / 2;
    ASSERT_NEAR(results[0][j], avg, 2e-4f * (1 + std::fabs(avg))) << j;
  }
}

// PowerSGD from the first iteration on, the options of the tests below.
ReducerOptions powersgd_now() {
  ReducerOptions options = compressed(Compression::kPowerSgd);
  options.powersgd_start_iteration = 0;
  return options;
}

// The review's cases: a zero gradient must not stall PowerSGD for ever, a
// non-finite one must not poison later iterations, an unused tensor keeps
// its residual, and a block of tiny values is kept rather than miscoded.
TEST(PowerSgdWire, AZeroGradientDoesNotStallTheWarmStart) {
  const size_t n = 64;
  std::vector<GradSpec> specs = {{DType::kFloat32, n * n, "w", n}};
  run_ranks(2, [&](Engine& e) {
    auto reducer = e.make_reducer(specs, powersgd_now());
    for (int it = 0; it < 3; ++it) {
      std::vector<float> g(n * n, it == 0 ? 0.0f : 1.0f);  // rank 1, a constant: exact
      reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat32, g.size(), {}});
      reducer->wait();
      for (float x : {g[0], g[n * n / 2], g[n * n - 1]}) {
        EXPECT_NEAR(x, it == 0 ? 0.0f : 1.0f, 1e-4f) << "iteration " << it;
      }
    }
  });
}

TEST(PowerSgdWire, ANonFiniteGradientIsNaNOnceAndTheNextIterationsAreClean) {
  const size_t n = 32;
  std::vector<GradSpec> specs = {{DType::kFloat32, n * n, "w", n}};
  run_ranks(2, [&](Engine& e) {
    auto reducer = e.make_reducer(specs, powersgd_now());
    for (int it = 0; it < 4; ++it) {
      std::vector<float> g(n * n, 2.0f);
      if (it == 1 && e.rank() == 1) g[5] = std::numeric_limits<float>::infinity();
      reducer->mark_ready(0, TensorRef{g.data(), DType::kFloat32, g.size(), {}});
      reducer->wait();
      if (it == 1) {
        EXPECT_TRUE(std::isnan(g[0]));
        EXPECT_TRUE(std::isnan(g[n * n - 1]));
      } else {
        EXPECT_NEAR(g[0], 2.0f, 1e-3f) << "iteration " << it;
        EXPECT_NEAR(g[n * n - 1], 2.0f, 1e-3f) << "iteration " << it;
      }
    }
  });
}

class UnusedKeepsResidual : public ::testing::TestWithParam<Compression> {};

TEST_P(UnusedKeepsResidual, AnUnusedTensorContributesZerosAndKeepsItsResidual) {
  const size_t n = 48;
  std::vector<GradSpec> specs = {{DType::kFloat32, n * n, "w", n},
                                 {DType::kFloat32, n * n, "v", n}};
  run_ranks(2, [&](Engine& e) {
    ReducerOptions options = compressed(GetParam());
    options.powersgd_start_iteration = 0;
    auto reducer = e.make_reducer(specs, options);
    std::vector<std::vector<float>> grads(2);
    for (size_t i = 0; i < 2; ++i) grads[i] = gradient(e.rank(), i, n * n, 0);
    for (size_t i = 0; i < 2; ++i) {
      reducer->mark_ready(i, TensorRef{grads[i].data(), DType::kFloat32, n * n, {}});
    }
    reducer->wait();
    // This rank's coding's residual: its first n * n elements (int8 and int4
    // keep the owner's residual after it, which an unused tensor's zeros
    // still travel with).
    const TensorRef r = reducer->residual(0);
    const std::vector<float> kept(static_cast<const float*>(r.data),
                                  static_cast<const float*>(r.data) + n * n);
    double norm = 0.0;
    for (float x : kept) norm += std::fabs(x);
    EXPECT_GT(norm, 0.0);
    // Iteration 1: tensor 0 unused on this rank (both ranks), tensor 1 used.
    std::vector<float> other = gradient(e.rank(), 1, n * n, 1);
    reducer->mark_unused(0);
    reducer->mark_ready(1, TensorRef{other.data(), DType::kFloat32, n * n, {}});
    reducer->wait();
    const TensorRef after = reducer->residual(0);
    EXPECT_EQ(std::vector<float>(static_cast<const float*>(after.data),
                                 static_cast<const float*>(after.data) + n * n),
              kept);
  });
}

INSTANTIATE_TEST_SUITE_P(Codings, UnusedKeepsResidual,
                         ::testing::Values(Compression::kInt8, Compression::kPowerSgd,
                                           Compression::kInt4));

}  // namespace
}  // namespace hemiola
