// The engine end to end with N ranks as threads of this process: real Gloo
// over loopback TCP, rendezvous through an in-process MemoryStore.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <thread>

#include "core/dtype_math.h"
#include "core/half_cast.h"
#include "engine/codec/block_coding.h"
#include "hemiola/hemiola.h"
#include "run_ranks.h"

namespace hemiola {
namespace {

using test::run_ranks;

template <typename T>
std::vector<T> filled(size_t n, float value, T (*convert)(float)) {
  return std::vector<T>(n, convert(value));
}

float identity(float f) { return f; }
double to_double(float f) { return f; }

class EngineWorlds : public ::testing::TestWithParam<int> {};

TEST_P(EngineWorlds, AllReduceSumAndAverageInEveryFloatDtype) {
  const int world = GetParam();
  run_ranks(world, [&](Engine& e) {
    const float mine = static_cast<float>(e.rank() + 1);
    const float sum = world * (world + 1) / 2.0f;
    const size_t n = 1000003;  // odd size: uneven ring segments
    auto f32 = filled<float>(n, mine, identity);
    e.all_reduce({f32.data(), DType::kFloat32, n, {}}, ReduceOp::kSum).wait();
    EXPECT_EQ(f32.front(), sum);
    EXPECT_EQ(f32.back(), sum);
    auto f64 = filled<double>(n, mine, to_double);
    e.all_reduce({f64.data(), DType::kFloat64, n, {}}, ReduceOp::kAverage).wait();
    EXPECT_EQ(f64[n / 2], sum / world);
    auto f16 = filled<uint16_t>(77, mine, float_to_fp16);
    e.all_reduce({f16.data(), DType::kFloat16, 77, {}}, ReduceOp::kSum).wait();
    EXPECT_EQ(fp16_to_float(f16[76]), sum);
    auto bf16 = filled<uint16_t>(77, mine, float_to_bf16);
    e.all_reduce({bf16.data(), DType::kBFloat16, 77, {}}, ReduceOp::kAverage).wait();
    EXPECT_EQ(bf16_to_float(bf16[3]), sum / world);
    std::vector<int64_t> counts(5, e.rank());
    e.all_reduce({counts.data(), DType::kInt64, 5, {}}, ReduceOp::kSum).wait();
    EXPECT_EQ(counts[4], world * (world - 1) / 2);
  });
}

TEST_P(EngineWorlds, BroadcastAllGatherBarrier) {
  const int world = GetParam();
  run_ranks(world, [&](Engine& e) {
    std::vector<int32_t> data(10, e.rank() == world - 1 ? 42 : -1);
    e.broadcast({data.data(), DType::kInt32, 10, {}}, world - 1).wait();
    EXPECT_EQ(data[9], 42);
    std::vector<double> mine(3, e.rank());
    std::vector<double> all(3 * world, -1);
    e.all_gather({mine.data(), DType::kFloat64, 3, {}}, {all.data(), DType::kFloat64, all.size(), {}})
        .wait();
    for (int r = 0; r < world; ++r) EXPECT_EQ(all[3 * r + 2], r);
    e.barrier().wait();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, EngineWorlds, ::testing::Values(1, 2, 3, 4));

// Each rank's tensors after one sum over `stripes` Gloo connections: a large
// float32 one (striped), a small one (below the stripes' minimum: one
// connection) and an int64 one; rank r's values are random, seeded by r.
std::vector<std::vector<float>> sums_over_stripes(int world, int stripes,
                                                  std::vector<std::vector<int64_t>>* counts) {
  const size_t large = 1000003, small = 1000;
  std::vector<std::vector<float>> results(world);
  counts->assign(world, {});
  run_ranks(
      world,
      [&](Engine& e) {
        std::mt19937 rng(static_cast<unsigned>(e.rank()));
        std::normal_distribution<float> normal;
        std::vector<float> x(large + small);
        for (float& v : x) v = normal(rng);
        e.all_reduce({x.data(), DType::kFloat32, large, {}}, ReduceOp::kSum).wait();
        e.all_reduce({x.data() + large, DType::kFloat32, small, {}}, ReduceOp::kAverage).wait();
        std::vector<int64_t> c(300000, e.rank() + 1);
        e.all_reduce({c.data(), DType::kInt64, c.size(), {}}, ReduceOp::kSum).wait();
        results[e.rank()] = std::move(x);
        (*counts)[e.rank()] = std::move(c);
      },
      30, [&](EngineOptions& options) { options.gloo_stripes = stripes; });
  return results;
}

TEST(GlooStripes, AStripedSumIsOneConnectionsSumOnEveryRank) {
  // Two ranks: a + b is the same float whatever the order, so the striped
  // sums must be one connection's bit for bit. Three: the ring's order per
  // element depends on where the parts are cut, so within rounding of the
  // exact sum; every rank must still hold the same bits.
  for (int world : {2, 3}) {
    std::vector<std::vector<int64_t>> counts1, counts3;
    const auto one = sums_over_stripes(world, 1, &counts1);
    const auto three = sums_over_stripes(world, 3, &counts3);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(three[r].size(), one[r].size());
      EXPECT_EQ(std::memcmp(three[r].data(), three[0].data(), three[r].size() * 4), 0)
          << "rank " << r << " of " << world << " differs from rank 0";
      EXPECT_EQ(counts3[r], std::vector<int64_t>(300000, world * (world + 1) / 2));
      if (world == 2) {
        EXPECT_EQ(std::memcmp(three[r].data(), one[r].data(), one[r].size() * 4), 0);
      } else {
        for (size_t i = 0; i < one[r].size(); i += 997) {
          EXPECT_NEAR(three[r][i], one[r][i], 1e-5f * (1.0f + std::fabs(one[r][i])));
        }
      }
    }
  }
}

TEST(GlooStripes, RanksThatDisagreeOnStripesFailSayingWhatToSet) {
  const auto failures = test::ranks_failures(
      2, [](Engine&) {}, 10,
      [](EngineOptions& options) { options.gloo_stripes = options.rank == 0 ? 2 : 1; });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(failures[r].find("set HEMIOLA_GLOO_STRIPES alike on every rank"),
              std::string::npos)
        << "rank " << r << ": " << failures[r];
  }
}

TEST(Reducer, AveragesGradientsMarkedInAnyOrderFromManyThreads) {
  const int world = 3;
  const size_t tensors = 60;
  std::vector<std::vector<std::vector<size_t>>> plans(world);
  run_ranks(world, [&](Engine& e) {
    std::vector<GradSpec> specs;
    for (size_t i = 0; i < tensors; ++i) {
      specs.push_back({DType::kFloat32, 1 + (i * 37) % 500, "p" + std::to_string(i)});
    }
    ReducerOptions options;
    options.fusion_bytes = 1024;
    options.first_bucket_bytes = 256;
    auto reducer = e.make_reducer(specs, options);
    std::vector<std::vector<float>> grads(tensors);
    std::mt19937 rng(1234 + e.rank());
    for (int iteration = 0; iteration < 3; ++iteration) {
      for (size_t i = 0; i < tensors; ++i) {
        grads[i].assign(specs[i].numel, static_cast<float>((e.rank() + 1) * (i + 1) + iteration));
      }
      // Each rank produces gradients in its own random order, from 4 threads.
      std::vector<size_t> order(tensors);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<std::thread> hooks;
      for (int t = 0; t < 4; ++t) {
        hooks.emplace_back([&, t] {
          for (size_t k = t; k < tensors; k += 4) {
            const size_t i = order[k];
            reducer->mark_ready(i, TensorRef{grads[i].data(), DType::kFloat32, specs[i].numel, {}});
          }
        });
      }
      for (auto& h : hooks) h.join();
      reducer->wait();
      for (size_t i = 0; i < tensors; ++i) {
        // mean over ranks of (r + 1) * (i + 1) + iteration
        const float expected = (world + 1) / 2.0f * (i + 1) + iteration;
        ASSERT_FLOAT_EQ(grads[i].front(), expected) << "tensor " << i << " iteration " << iteration;
        ASSERT_FLOAT_EQ(grads[i].back(), expected);
      }
      if (iteration == 0) {
        EXPECT_EQ(reducer->observed_order().size(), tensors);
        reducer->rebuild_from_observed_order();
      }
    }
    EXPECT_EQ(reducer->iterations_started(), 3u);
    plans[e.rank()] = reducer->buckets();
  });
  // After the rebuild every rank holds rank 0's plan.
  EXPECT_GT(plans[0].size(), 5u);
  EXPECT_EQ(plans[1], plans[0]);
  EXPECT_EQ(plans[2], plans[0]);
}

TEST(Reducer, MarkingTwiceInOneIterationIsAnError) {
  run_ranks(1, [&](Engine& e) {
    std::vector<GradSpec> specs = {{DType::kFloat32, 2, "w"}, {DType::kFloat32, 2, "b"}};
    auto reducer = e.make_reducer(specs, ReducerOptions{});
    std::vector<float> g(2, 1.0f);
    reducer->mark_ready(0, g.data());
    try {
      reducer->mark_ready(0, g.data());
      ADD_FAILURE() << "double mark accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("'w' was marked ready twice"), std::string::npos);
    }
    EXPECT_EQ(reducer->unmarked(), std::vector<size_t>{1});
    reducer->mark_ready(1, g.data());
    reducer->wait();
  });
}

TEST(Reducer, UsageCountsRanksThatProducedEachGradient) {
  const int world = 3;
  run_ranks(world, [&](Engine& e) {
    std::vector<GradSpec> specs = {{DType::kFloat32, 4, "used"}, {DType::kFloat32, 4, "rank0"},
                                   {DType::kFloat32, 4, "nobody"}};
    ReducerOptions options;
    options.track_usage = true;
    auto reducer = e.make_reducer(specs, options);
    std::vector<float> g0(4, 3.0f), g1(4, 6.0f);
    reducer->mark_ready(0, g0.data());
    if (e.rank() == 0) {
      reducer->mark_ready(1, g1.data());
    } else {
      reducer->mark_unused(1);
    }
    reducer->mark_unused(2);
    const int64_t iteration = reducer->finish_marking();
    ASSERT_EQ(iteration, 0);
    reducer->wait(iteration);
    EXPECT_EQ(reducer->usage(iteration), (std::vector<int>{world, 1, 0}));
    const TensorRef result = reducer->result(iteration, 1);
    ASSERT_EQ(result.numel, 4u);
    // zeros from the ranks that did not use it
    EXPECT_FLOAT_EQ(static_cast<const float*>(result.data)[0], 6.0f / world);
  });
}

TEST(Reducer, NextIterationMarksWhileThePreviousOneIsStillReducing) {
  // in_flight = 1: iteration k + 1 packs its gradients into buffers of its own
  // while iteration k's reduction may still run; results of k stay readable
  // (without write-back) until k + 2 starts.
  const int world = 2;
  run_ranks(world, [&](Engine& e) {
    std::vector<GradSpec> specs = {{DType::kFloat32, 1000, "w"}, {DType::kFloat64, 10, "b"}};
    ReducerOptions options;
    options.in_flight = 1;
    options.fusion_bytes = options.first_bucket_bytes = 64;
    auto reducer = e.make_reducer(specs, options);
    std::vector<float> w(1000);
    std::vector<double> b(10);
    for (uint64_t k = 0; k < 6; ++k) {
      std::fill(w.begin(), w.end(), static_cast<float>((e.rank() + 1) * (k + 1)));
      std::fill(b.begin(), b.end(), static_cast<double>(e.rank() * 10 + k));
      reducer->mark_ready(1, b.data(), nullptr);  // source reusable at once
      reducer->mark_ready(0, w.data(), nullptr);
      std::fill(w.begin(), w.end(), -1.0f);  // clobber the source: must not matter
      EXPECT_EQ(reducer->finish_marking(), static_cast<int64_t>(k));
      if (k > 0) {
        // The previous iteration: wait and read it now, while k is in flight.
        reducer->wait(k - 1);
        const TensorRef rw = reducer->result(k - 1, 0);
        const TensorRef rb = reducer->result(k - 1, 1);
        EXPECT_FLOAT_EQ(static_cast<const float*>(rw.data)[999], 1.5f * k);
        EXPECT_DOUBLE_EQ(static_cast<const double*>(rb.data)[0], 5.0 + (k - 1));
      }
    }
    reducer->wait(5);
    EXPECT_THROW(reducer->result(3, 0), Error);  // reused by iteration 5
    EXPECT_DOUBLE_EQ(static_cast<const double*>(reducer->result(5, 1).data)[9], 10.0);
  });
}

TEST(Reducer, CustomIssueOrderAndPerTensorWaits) {
  // Buckets are issued in the order set (the same on every rank), and a wait
  // for some tensors returns once their buckets are reduced.
  const int world = 2;
  run_ranks(world, [&](Engine& e) {
    std::vector<GradSpec> specs;
    for (int i = 0; i < 6; ++i) specs.push_back({DType::kFloat32, 100, "p" + std::to_string(i)});
    ReducerOptions options;
    options.fusion_bytes = options.first_bucket_bytes = 400;  // one tensor per bucket
    options.in_flight = 1;
    auto reducer = e.make_reducer(specs, options);
    ASSERT_EQ(reducer->buckets().size(), 6u);
    const std::vector<size_t> order = {0, 1, 2, 5, 4, 3};
    reducer->set_issue_order(order);
    EXPECT_EQ(reducer->issue_order(), order);
    std::vector<std::vector<float>> grads(6, std::vector<float>(100));
    for (size_t i = 0; i < 6; ++i) {
      std::fill(grads[i].begin(), grads[i].end(), static_cast<float>(e.rank() + i));
      reducer->mark_ready(i, grads[i].data(), nullptr);
    }
    const int64_t it = reducer->finish_marking();
    // Bucket 3 is issued last here: once its tensor has arrived, every tensor has.
    const size_t last = reducer->buckets()[3][0];
    reducer->wait_for(it, {last});
    std::vector<size_t> all = {0, 1, 2, 3, 4, 5};
    EXPECT_EQ(reducer->arrived(it, all), all);
    for (size_t i = 0; i < 6; ++i) {
      reducer->wait_for(it, {i});
      EXPECT_FLOAT_EQ(static_cast<const float*>(reducer->result(0, i).data)[0],
                      static_cast<float>(i) + 0.5f);
    }
    // Not yet started: nothing has arrived.
    EXPECT_TRUE(reducer->arrived(it + 1, all).empty());
    EXPECT_THROW(reducer->arrived(it, {6}), Error);
  });
}

TEST(Reducer, PerTensorWaitsBeforeAndAfterARebuild) {
  const int world = 2;
  run_ranks(world, [&](Engine& e) {
    std::vector<GradSpec> specs;
    for (int i = 0; i < 3; ++i) specs.push_back({DType::kFloat32, 50, "p" + std::to_string(i)});
    ReducerOptions options;
    options.fusion_bytes = options.first_bucket_bytes = 200;  // one tensor per bucket
    auto reducer = e.make_reducer(specs, options);
    std::vector<std::vector<float>> grads(3, std::vector<float>(50, 1.0f));
    reducer->mark_ready(2, grads[2].data());
    // Its own iteration is still being marked: an error, not a wait for a
    // gradient this thread has yet to give.
    EXPECT_THROW(reducer->wait_for(0, {2}), Error);
    reducer->mark_ready(1, grads[1].data());
    reducer->mark_ready(0, grads[0].data());
    const int64_t it = reducer->finish_marking();
    reducer->wait_for(it, {0, 2});
    EXPECT_EQ(reducer->arrived(it, {0, 2}), (std::vector<size_t>{0, 2}));
    // A rebuild makes new buffers: iteration 0 is long done, and its results gone.
    reducer->rebuild({0, 1, 2});
    EXPECT_EQ(reducer->arrived(it, {0, 1, 2}), (std::vector<size_t>{0, 1, 2}));
    reducer->wait_for(it, {1});
    EXPECT_THROW(reducer->result(it, 1), Error);
  });
}

TEST(Reducer, PartitionedTensorsAreReducedPieceByPiece) {
  const int world = 3;
  run_ranks(world, [&](Engine& e) {
    std::vector<GradSpec> specs = {{DType::kFloat32, 10, "small"},
                                   {DType::kFloat32, 100003, "huge"},
                                   {DType::kBFloat16, 5000, "half"}};
    ReducerOptions options;
    options.partition_bytes = 4096;
    options.fusion_bytes = 8192;
    options.first_bucket_bytes = 4096;
    auto reducer = e.make_reducer(specs, options);
    size_t buckets_with_huge = 0;
    for (const auto& bucket : reducer->buckets()) {
      buckets_with_huge += std::count(bucket.begin(), bucket.end(), size_t{1});
    }
    EXPECT_GT(buckets_with_huge, 40u);
    std::vector<float> small(10), huge(100003);
    std::vector<uint16_t> half(5000);
    for (int iteration = 0; iteration < 2; ++iteration) {
      for (size_t i = 0; i < huge.size(); ++i) huge[i] = static_cast<float>(i % 97) * (e.rank() + 1);
      std::fill(small.begin(), small.end(), 1.0f);
      std::fill(half.begin(), half.end(), float_to_bf16(static_cast<float>(e.rank())));
      reducer->mark_ready(1, huge.data());
      reducer->mark_ready(2, half.data());
      reducer->mark_ready(0, small.data());
      reducer->wait();
      for (size_t i = 0; i < huge.size(); i += 997) {
        ASSERT_FLOAT_EQ(huge[i], static_cast<float>(i % 97) * 2.0f) << i;  // mean of 1, 2, 3
      }
      ASSERT_FLOAT_EQ(huge.back(), static_cast<float>((huge.size() - 1) % 97) * 2.0f);
      EXPECT_EQ(bf16_to_float(half[4999]), 1.0f);
      EXPECT_THROW(reducer->result(iteration, 1), Error);  // partitioned: no single view
      EXPECT_NO_THROW(reducer->result(iteration, 0));
    }
  });
}

TEST(Reducer, FinishingWithMissingGradientsNamesThem) {
  run_ranks(1, [&](Engine& e) {
    std::vector<GradSpec> specs = {{DType::kFloat32, 2, "seen"}, {DType::kFloat32, 2, "lost"}};
    auto reducer = e.make_reducer(specs, ReducerOptions{});
    std::vector<float> g(2, 1.0f);
    reducer->mark_ready(0, g.data());
    try {
      reducer->finish_marking();
      ADD_FAILURE() << "finish_marking accepted a missing gradient";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("lost"), std::string::npos);
    }
    reducer->mark_unused(1);
    reducer->wait();
  });
}

TEST(Reducer, AbortWakesTheSchedulerAndFailsWait) {
  run_ranks(1, [&](Engine& e) {
    std::vector<GradSpec> specs = {{DType::kFloat32, 2, "a"}, {DType::kFloat32, 2, "b"}};
    ReducerOptions options;
    options.fusion_bytes = options.first_bucket_bytes = 1;
    auto reducer = e.make_reducer(specs, options);
    std::vector<float> g(2, 1.0f);
    reducer->mark_ready(0, g.data());  // "b" never comes
    const auto start = std::chrono::steady_clock::now();
    reducer->abort("test abort");
    try {
      reducer->wait();
      ADD_FAILURE() << "wait succeeded after abort";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), ErrorCode::kAborted);
      EXPECT_NE(std::string(err.what()).find("test abort"), std::string::npos);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    EXPECT_THROW(reducer->mark_ready(1, g.data()), Error);
  });
}

TEST(Engine, CollectiveTimesOutNamingTheMissingRank) {
  auto store = std::make_shared<MemoryStore>();
  std::string error;
  double seconds = 0;
  std::thread absent([&] {
    EngineOptions options;
    options.rank = 1;
    options.world_size = 2;
    options.hostname = "127.0.0.1";
    options.timeout_s = 1.0;
    Engine engine(options, store);
    std::this_thread::sleep_for(std::chrono::seconds(4));  // alive but never joins
  });
  {
    EngineOptions options;
    options.rank = 0;
    options.world_size = 2;
    options.hostname = "127.0.0.1";
    options.timeout_s = 1.0;
    Engine engine(options, store);
    std::vector<float> data(16, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      engine.all_reduce({data.data(), DType::kFloat32, 16, {}}).wait();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout);
      error = e.what();
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Sticky: the next operation fails at once, saying why.
    try {
      engine.barrier().wait();
      ADD_FAILURE() << "barrier after a failed collective succeeded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("failed earlier"), std::string::npos);
    }
  }
  absent.join();
  EXPECT_NE(error.find("all_reduce(sum) of 16 float32"), std::string::npos) << error;
  EXPECT_NE(error.find("Ranks missing"), std::string::npos) << error;
  EXPECT_NE(error.find("[1]"), std::string::npos) << error;
  EXPECT_LT(seconds, 1.0 + 1.0 + 2.0);  // timeout + grace + slack
}

TEST(Engine, RendezvousTimesOutWhenARankNeverArrives) {
  auto store = std::make_shared<MemoryStore>();
  EngineOptions options;
  options.rank = 0;
  options.world_size = 2;
  options.hostname = "127.0.0.1";
  options.timeout_s = 0.5;
  try {
    Engine engine(options, store);
    FAIL() << "rendezvous with a missing rank succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  }
}

TEST(Engine, BuildInfoSaysWhatWasCompiledIn) {
  const std::string info = build_info();
  EXPECT_NE(info.find("gloo: yes"), std::string::npos);
  EXPECT_NE(info.find("cuda: "), std::string::npos);
  EXPECT_NE(info.find("nccl: "), std::string::npos);
}

}  // namespace
}  // namespace hemiola

namespace hemiola {
namespace {

// reduce_scatter is the first half of all_reduce, bit for bit: on each rank's
// chunk it leaves exactly what all_reduce (sum or average) leaves there, at
// every rank count, for sizes from a few elements (empty chunks) to several
// ring segments per rank, in float32 and bfloat16; all_gather_chunks then
// makes every rank's tensor the all-reduce's.
class ReduceScatterWorlds : public ::testing::TestWithParam<int> {};

TEST_P(ReduceScatterWorlds, EachChunkIsTheAllReducesBitForBit) {
  const int world = GetParam();
  for (const size_t numel : {size_t{1}, size_t{7}, size_t{1000}, size_t{1234567}}) {
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
        test::run_ranks(world, [&](Engine& e) {
          const size_t elem = dtype_size(dtype);
          std::mt19937 rng(static_cast<unsigned>(17 * e.rank() + numel));
          std::normal_distribution<float> normal;
          std::vector<float> values(numel);
          for (float& v : values) v = normal(rng) * 1e3f;
          std::vector<uint8_t> reference(numel * elem), sharded;
          if (dtype == DType::kFloat32) {
            std::memcpy(reference.data(), values.data(), numel * elem);
          } else {
            floats_to_halves(dtype, values.data(), reinterpret_cast<uint16_t*>(reference.data()),
                             numel, 1.0f);
          }
          sharded = reference;
          e.all_reduce({reference.data(), dtype, numel, {}}, op).wait();
          e.reduce_scatter({sharded.data(), dtype, numel, {}}, op).wait();
          const std::vector<size_t> bounds = chunk_bounds(numel, dtype, world);
          ASSERT_EQ(bounds.size(), static_cast<size_t>(world) + 1);
          EXPECT_EQ(bounds.front(), 0u);
          EXPECT_EQ(bounds.back(), numel);
          const size_t lo = bounds[e.rank()] * elem, hi = bounds[e.rank() + 1] * elem;
          EXPECT_EQ(0, std::memcmp(sharded.data() + lo, reference.data() + lo, hi - lo))
              << "rank " << e.rank() << " of " << world << ", " << numel << " elements";
          e.all_gather_chunks({sharded.data(), dtype, numel, {}}).wait();
          EXPECT_EQ(sharded, reference) << "rank " << e.rank() << ", " << numel << " elements";
        });
      }
    }
  }
}

// all_gather_chunks over chunks given by the caller (a reduce-scatter of the
// same elements in bfloat16 cuts them elsewhere than float32's ring would).
TEST_P(ReduceScatterWorlds, GathersTheChunksItIsGiven) {
  const int world = GetParam();
  const size_t numel = 300001;
  const std::vector<size_t> bounds = chunk_bounds(numel, DType::kBFloat16, world);
  test::run_ranks(world, [&](Engine& e) {
    std::vector<float> x(numel, -1.0f);
    for (size_t i = bounds[e.rank()]; i < bounds[e.rank() + 1]; ++i) x[i] = float(e.rank());
    e.all_gather_chunks({x.data(), DType::kFloat32, numel, {}}, bounds).wait();
    for (int r = 0; r < world; ++r) {
      for (size_t i = bounds[r]; i < bounds[r + 1]; ++i) ASSERT_EQ(x[i], float(r)) << i;
    }
    std::vector<size_t> wrong = bounds;
    wrong.back() = numel + 1;
    if (world > 1) {
      EXPECT_THROW(e.all_gather_chunks({x.data(), DType::kFloat32, numel, {}}, wrong).wait(),
                   std::exception);
    }
  });
}

// all_gather_chunks over segments in separate memory gathers what it gathers
// over their concatenation: pieces of chunks land in the right segment, a
// chunk spanning several segments and an empty segment included.
TEST_P(ReduceScatterWorlds, GathersIntoSegmentsInPlace) {
  const int world = GetParam();
  const std::vector<size_t> sizes = {5, 70001, 0, 3, 130000, 17};
  size_t numel = 0;
  for (size_t n : sizes) numel += n;
  test::run_ranks(world, [&](Engine& e) {
    const std::vector<size_t> bounds = chunk_bounds(numel, DType::kFloat32, world);
    std::vector<float> whole(numel, -1.0f);
    for (size_t i = bounds[e.rank()]; i < bounds[e.rank() + 1]; ++i) whole[i] = float(i % 977);
    std::vector<std::vector<float>> parts;
    std::vector<TensorRef> segments;
    size_t at = 0;
    for (size_t n : sizes) {
      parts.emplace_back(whole.begin() + at, whole.begin() + at + n);
      at += n;
    }
    for (auto& part : parts) segments.push_back({part.data(), DType::kFloat32, part.size(), {}});
    e.all_gather_chunks(segments).wait();
    e.all_gather_chunks({whole.data(), DType::kFloat32, numel, {}}).wait();
    at = 0;
    for (const auto& part : parts) {
      for (size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], whole[at + i]) << at + i;
      at += part.size();
    }
    for (size_t i = 0; i < numel; ++i) ASSERT_EQ(whole[i], float(i % 977)) << i;
  });
}

// reduce_scatter_coded: this rank's chunk is the float32 average, in rank
// order, of every rank's int8/int4 records of it (each rank coding its value
// plus its residual with its own scales), bit for bit, and the residual keeps
// what the coding dropped; twice in a row, so the feedback is used.
template <typename Codes>
void expect_coded_reduce_scatter(int world, size_t numel, Compression coding) {
  const std::vector<size_t> bounds = coded_chunk_bounds(numel, world);
  ASSERT_EQ(bounds.size(), static_cast<size_t>(world) + 1);
  EXPECT_EQ(bounds.back(), numel);
  auto input = [numel](int rank, int call) {
    std::mt19937 rng(static_cast<unsigned>(31 * rank + 7 * call + numel));
    std::normal_distribution<float> normal;
    std::vector<float> x(numel);
    for (float& v : x) v = normal(rng) * (rank + 1.0f);
    return x;
  };
  test::run_ranks(world, [&](Engine& e) {
    // every rank's residuals and records, as each rank computes its own
    std::vector<std::vector<float>> residuals(world, std::vector<float>(numel, 0.0f));
    std::vector<float> residual(numel, 0.0f);
    for (int call = 0; call < 2; ++call) {
      std::vector<float> expected(numel, 0.0f);
      for (int r = 0; r < world; ++r) {
        std::vector<float> v = input(r, call);
        for (size_t i = 0; i < numel; ++i) v[i] += residuals[r][i];
        for (size_t at = 0; at < numel; at += kInt8Block) {
          const size_t count = std::min(kInt8Block, numel - at);
          std::vector<uint8_t> record(block_coding::record_bytes<Codes>());
          block_coding::code<Codes>(v.data() + at, count, record.data());
          block_coding::decode<Codes, true>(record.data(), count, expected.data() + at);
        }
        residuals[r] = v;
      }
      for (float& v : expected) v *= 1.0f / static_cast<float>(world);
      std::vector<float> x = input(e.rank(), call);
      e.reduce_scatter_coded({x.data(), DType::kFloat32, numel, {}},
                             {residual.data(), DType::kFloat32, numel, {}}, coding).wait();
      const size_t lo = bounds[e.rank()], hi = bounds[e.rank() + 1];
      EXPECT_EQ(0, std::memcmp(x.data() + lo, expected.data() + lo, (hi - lo) * sizeof(float)))
          << "rank " << e.rank() << " of " << world << ", " << numel << " elements, call " << call;
      EXPECT_EQ(residual, residuals[e.rank()]) << "rank " << e.rank() << ", call " << call;
    }
  });
}

TEST_P(ReduceScatterWorlds, CodedChunkIsTheAverageOfEveryRanksRecords) {
  for (const size_t numel : {size_t{1}, size_t{300}, size_t{70001}}) {
    expect_coded_reduce_scatter<Int8Codes>(GetParam(), numel, Compression::kInt8);
    expect_coded_reduce_scatter<Int4Codes>(GetParam(), numel, Compression::kInt4);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReduceScatterWorlds, ::testing::Values(1, 2, 3, 4));

TEST(CodedChunkBounds, WholeBlocksInRankOrder) {
  EXPECT_EQ(coded_chunk_bounds(1000, 2), (std::vector<size_t>{0, 512, 1000}));
  EXPECT_EQ(coded_chunk_bounds(300, 4), (std::vector<size_t>{0, 256, 300, 300, 300}));
  EXPECT_EQ(coded_chunk_bounds(0, 3), (std::vector<size_t>{0, 0, 0, 0}));
}

TEST(ReduceScatterCoded, RefusesWhatItCannotCode) {
  test::run_ranks(1, [](Engine& e) {
    std::vector<float> x(10), r(9);
    EXPECT_THROW(e.reduce_scatter_coded({x.data(), DType::kFloat32, 10, {}},
                                        {r.data(), DType::kFloat32, 9, {}}, Compression::kInt8),
                 std::exception);
    std::vector<float> r10(10);
    EXPECT_THROW(e.reduce_scatter_coded({x.data(), DType::kFloat32, 10, {}},
                                        {r10.data(), DType::kFloat32, 10, {}}, Compression::kFp16),
                 std::exception);
  });
}

TEST(ChunkBounds, CoverTheTensorInRankOrder) {
  for (int world : {1, 2, 3, 5, 8}) {
    for (size_t numel : {size_t{0}, size_t{3}, size_t{100}, size_t{1} << 22}) {
      const std::vector<size_t> b = chunk_bounds(numel, DType::kFloat32, world);
      ASSERT_EQ(b.size(), static_cast<size_t>(world) + 1);
      EXPECT_EQ(b.front(), 0u);
      EXPECT_EQ(b.back(), numel);
      for (int r = 0; r < world; ++r) EXPECT_LE(b[r], b[r + 1]);
    }
  }
  // A large tensor is shared out evenly (within a segment per rank).
  const std::vector<size_t> b = chunk_bounds(size_t{1} << 24, DType::kFloat32, 4);
  for (int r = 0; r < 4; ++r) EXPECT_NEAR(double(b[r + 1] - b[r]), double(1 << 22), 1 << 18);
}

}  // namespace
}  // namespace hemiola
