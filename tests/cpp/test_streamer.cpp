// The streaming schedule (hemiola/streamer.h) against DiLoCo's math written
// out here: ranks as threads over real Gloo, each with its own "inner
// optimizer" (a deterministic per-rank drift of the parameters).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hemiola/hemiola.h"
#include "run_ranks.h"

namespace hemiola {
namespace {

using test::run_ranks;

// Options of rank `rank` of `size` ranks over loopback; `diagnose`: name
// missing ranks after a failure (a wait the elastic tests do without).
EngineOptions loopback(int rank, int size, bool diagnose = true) {
  EngineOptions o;
  o.rank = rank;
  o.world_size = size;
  o.hostname = "127.0.0.1";
  o.timeout_s = 30;
  o.diagnose_failures = diagnose;
  return o;
}

// What rank r's inner step s does to element i: a drift that differs by rank.
float drift(int rank, uint64_t step, size_t i) {
  return 0.01f * static_cast<float>((rank + 1) * (1 + (step + i) % 5)) - 0.02f;
}

// Torch's SGD with momentum and Nesterov on one element (the outer step).
struct OuterRef {
  float shared, momentum;
  bool started = false;
  void step(float g, float lr, float mu) {
    momentum = started ? mu * momentum + g : g;
    started = true;
    const float d = g + mu * momentum;
    shared = shared - lr * d;
  }
};

// Runs `steps` inner steps on `world` ranks with the options; returns each
// rank's final parameters (two tensors, concatenated) and its shared copies.
struct Result {
  std::vector<std::vector<float>> live, shared;
  uint64_t syncs = 0;
};

// The live values (a then b) and the shared copies of `streamer` into
// `result` at `slot`.
void record(Streamer& streamer, const std::vector<float>& a, const std::vector<float>& b,
            Result& result, int slot) {
  result.live[slot] = a;
  result.live[slot].insert(result.live[slot].end(), b.begin(), b.end());
  for (size_t f = 0; f < streamer.fragments().size(); ++f) {
    const TensorRef shared = streamer.shared(f);
    const float* data = static_cast<const float*>(shared.data);
    result.shared[slot].insert(result.shared[slot].end(), data, data + shared.numel);
  }
}

// `steps` inner steps of the two tensors drifting as rank `replica` does,
// streamed across `engine`'s ranks (and `group`'s, if any); the live values
// and shared copies into `result` at `slot`. Returns the syncs.
uint64_t train(Engine& engine, Engine* group, int replica, const StreamerOptions& options,
               uint64_t steps, Result& result, int slot) {
  std::vector<float> a(40, 1.0f), b(24, -0.5f);
  auto streamer = engine.make_streamer(
      {{"a", TensorRef{a.data(), DType::kFloat32, a.size(), {}}},
       {"b", TensorRef{b.data(), DType::kFloat32, b.size(), {}}}},
      options, group);
  for (uint64_t s = 1; s <= steps; ++s) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += drift(replica, s, i);
    for (size_t i = 0; i < b.size(); ++i) b[i] += drift(replica, s, 100 + i);
    streamer->after_inner_step();
  }
  streamer->wait_in_flight();
  record(*streamer, a, b, result, slot);
  return streamer->syncs();
}

Result run(int world, const StreamerOptions& options, uint64_t steps) {
  Result result;
  result.live.resize(world);
  result.shared.resize(world);
  std::vector<uint64_t> syncs(world);
  run_ranks(world, [&](Engine& engine) {
    syncs[engine.rank()] = train(engine, nullptr, engine.rank(), options, steps, result,
                                 engine.rank());
  });
  result.syncs = syncs[0];
  return result;
}

TEST(Streamer, OneFragmentBlockingIsDiLoCo) {
  const int world = 3;
  StreamerOptions options;
  options.outer = StreamerOptions::diloco_outer();
  options.sync_every = 4;
  const uint64_t steps = 10;  // syncs after steps 4 and 8; 2 inner steps after
  const Result got = run(world, options, steps);
  EXPECT_EQ(got.syncs, 2u);
  // Reference: every element alone (the math is element-wise).
  const size_t n = 64;
  for (size_t i = 0; i < n; ++i) {
    const size_t key = i < 40 ? i : 100 + (i - 40);
    const float start = i < 40 ? 1.0f : -0.5f;
    OuterRef outer{start, 0.0f};
    std::vector<float> live(world, start);
    for (uint64_t s = 1; s <= steps; ++s) {
      for (int r = 0; r < world; ++r) live[r] += drift(r, s, key);
      if (s % options.sync_every == 0) {
        float sum = 0.0f;
        for (int r = 0; r < world; ++r) sum += outer.shared - live[r];
        outer.step(sum / world, 0.7f, 0.9f);
        for (int r = 0; r < world; ++r) live[r] = outer.shared;
      }
    }
    for (int r = 0; r < world; ++r) {
      EXPECT_NEAR(got.live[r][i], live[r], 1e-5f) << "rank " << r << " element " << i;
      EXPECT_EQ(got.shared[r][i], got.shared[0][i]) << "the shared copy differs across ranks";
    }
    EXPECT_NEAR(got.shared[0][i], outer.shared, 1e-5f) << "element " << i;
  }
}

TEST(Streamer, FragmentsAreStaggeredAndOverlapKeepsTheLocalProgress) {
  const int world = 2;
  StreamerOptions options;
  options.outer = StreamerOptions::diloco_outer();
  options.sync_every = 6;
  options.fragments = 2;
  options.overlap = 2;
  const uint64_t steps = 14;
  const Result got = run(world, options, steps);
  // 64 floats in two fragments of 32: the second tensor is cut. Fragment 0
  // (elements 0..31) syncs after steps 3, 9; fragment 1 after 6, 12, each
  // landing two steps later (the last at 14).
  EXPECT_EQ(got.syncs, 4u);
  for (size_t i = 0; i < 64; ++i) {
    const size_t key = i < 40 ? i : 100 + (i - 40);
    const float start = i < 40 ? 1.0f : -0.5f;
    const uint64_t offset = i < 32 ? 3 : 0;
    OuterRef outer{start, 0.0f};
    std::vector<float> live(world, start), base(world, start);
    float average = 0.0f;
    bool in_flight = false;
    uint64_t sent = 0;
    for (uint64_t s = 1; s <= steps; ++s) {
      for (int r = 0; r < world; ++r) live[r] += drift(r, s, key);
      if (in_flight && s >= sent + options.overlap) {
        outer.step(average, 0.7f, 0.9f);
        for (int r = 0; r < world; ++r) live[r] = outer.shared + (live[r] - base[r]);
        in_flight = false;
      }
      if (s % options.sync_every == offset) {
        float sum = 0.0f;
        for (int r = 0; r < world; ++r) {
          base[r] = live[r];
          sum += outer.shared - live[r];
        }
        average = sum / world;
        in_flight = true;
        sent = s;
      }
    }
    for (int r = 0; r < world; ++r) {
      EXPECT_NEAR(got.live[r][i], live[r], 1e-5f) << "rank " << r << " element " << i;
    }
    EXPECT_EQ(got.shared[1][i], got.shared[0][i]);
    EXPECT_NEAR(got.shared[0][i], outer.shared, 1e-5f) << "element " << i;
  }
}

class StreamerCoding : public ::testing::TestWithParam<Compression> {};

TEST_P(StreamerCoding, KeepsTheSharedCopyBitIdenticalAcrossRanks) {
  const int world = 3;
  StreamerOptions options;
  options.sync_every = 3;
  options.compression = GetParam();
  const Result got = run(world, options, 9);
  EXPECT_EQ(got.syncs, 3u);
  const Result exact = run(world, StreamerOptions{3, 1, 0, StreamerOptions::default_outer(),
                                                  Compression::kNone},
                           9);
  double distance = 0.0;
  for (size_t i = 0; i < got.shared[0].size(); ++i) {
    for (int r = 1; r < world; ++r) ASSERT_EQ(got.shared[r][i], got.shared[0][i]);
    for (int r = 0; r < world; ++r) ASSERT_EQ(got.live[r][i], got.shared[0][i]);
    distance = std::max(distance, std::fabs(double(got.shared[0][i]) - exact.shared[0][i]));
  }
  // The coding's step is 1/L of a block's largest value (int8: L = 127,
  // int4: L = 7, at any number of ranks), and what it drops waits in the
  // residuals: the shared copy strays from the exact one by a few steps at most.
  const int levels = GetParam() == Compression::kInt8 ? 127 : 7;
  EXPECT_GT(distance, 0.0) << "the coding changed nothing: was it applied?";
  EXPECT_LT(distance, 0.42 / levels) << "the coding with error feedback strays from the exact "
                                        "average";
}

INSTANTIATE_TEST_SUITE_P(Codings, StreamerCoding,
                         ::testing::Values(Compression::kInt8, Compression::kInt4));

// Replica groups: `groups` groups of `ranks` ranks each (threads), every
// rank of group g drifting as rank g of run() does (a per-step schedule
// keeps a group's ranks equal). Each rank makes its group's engine and the
// engine across groups (the ranks of its place in every group).
Result run_groups(int groups, int ranks, const StreamerOptions& options, uint64_t steps) {
  Result result;
  const int world = groups * ranks;
  result.live.resize(world);
  result.shared.resize(world);
  std::vector<uint64_t> syncs(world);
  std::vector<std::shared_ptr<MemoryStore>> group_stores, cross_stores;
  for (int g = 0; g < groups; ++g) group_stores.push_back(std::make_shared<MemoryStore>());
  for (int j = 0; j < ranks; ++j) cross_stores.push_back(std::make_shared<MemoryStore>());
  std::vector<std::string> failures(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        const int g = r / ranks, j = r % ranks;
        Engine group(loopback(j, ranks), group_stores[g]);
        Engine across(loopback(g, groups), cross_stores[j]);
        syncs[r] = train(across, &group, g, options, steps, result, r);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  result.syncs = syncs[0];
  return result;
}

// Two groups average exactly what two single-rank replicas average: each
// element's average is the same two values summed (whichever rank of a group
// carries its piece), so every rank of every group ends bitwise equal to the
// single-rank run, with pieces of uneven length (64 elements in 3 pieces of
// 22) and with fragments in flight.
TEST(Streamer, ReplicaGroupsAverageAsOneRankPerGroup) {
  StreamerOptions options;
  options.sync_every = 6;
  options.fragments = 2;
  options.overlap = 2;
  const uint64_t steps = 14;
  const Result alone = run(2, options, steps);
  for (int ranks : {2, 3}) {
    const Result grouped = run_groups(2, ranks, options, steps);
    EXPECT_EQ(grouped.syncs, alone.syncs);
    for (int r = 0; r < 2 * ranks; ++r) {
      ASSERT_EQ(grouped.live[r], alone.live[r / ranks]) << ranks << " ranks a group, rank " << r;
      ASSERT_EQ(grouped.shared[r], alone.shared[0]) << ranks << " ranks a group, rank " << r;
    }
  }
}

// With a coding, the pieces are coded apart (their own blocks), so the result
// is not the single-rank run's; it stays bitwise equal on every rank.
TEST(Streamer, ReplicaGroupsKeepTheSharedCopyBitIdenticalUnderACoding) {
  StreamerOptions options;
  options.sync_every = 3;
  options.compression = Compression::kInt8;
  const Result got = run_groups(2, 2, options, 9);
  EXPECT_EQ(got.syncs, 3u);
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(got.shared[r], got.shared[0]) << "rank " << r;
    EXPECT_EQ(got.live[r], got.shared[0]) << "rank " << r;
  }
}

// next_step_fragments() names, before each step, exactly the fragments that
// step sends or lands (a GPU model's host copy moves only those).
TEST(Streamer, NamesTheFragmentsTheNextStepTouches) {
  run_ranks(1, [](Engine& engine) {
    std::vector<float> a(40, 1.0f), b(24, -0.5f);
    StreamerOptions options;
    options.sync_every = 6;
    options.fragments = 2;
    options.overlap = 2;
    auto streamer = engine.make_streamer(
        {{"a", TensorRef{a.data(), DType::kFloat32, a.size(), {}}},
         {"b", TensorRef{b.data(), DType::kFloat32, b.size(), {}}}},
        options);
    // Fragment 0 is sent after steps 3 and 9 and lands two steps later;
    // fragment 1 after 6 and 12.
    const std::map<uint64_t, std::vector<size_t>> expected = {
        {3, {0}}, {5, {0}}, {6, {1}}, {8, {1}}, {9, {0}}, {11, {0}}, {12, {1}}, {14, {1}}};
    for (uint64_t s = 1; s <= 14; ++s) {
      const auto it = expected.find(s);
      EXPECT_EQ(streamer->next_step_fragments(),
                it == expected.end() ? std::vector<size_t>{} : it->second)
          << "step " << s;
      streamer->after_inner_step();
    }
  });
}

TEST(Streamer, RefusesWhatItCannotDo) {
  run_ranks(1, [](Engine& engine) {
    std::vector<float> a(8, 0.0f);
    std::vector<StreamedParameter> params{{"a", TensorRef{a.data(), DType::kFloat32, 8, {}}}};
    StreamerOptions options;
    options.sync_every = 4;
    options.fragments = 2;
    options.overlap = 2;  // 2 * 2 >= 4: two fragments could be on the wire
    EXPECT_THROW(engine.make_streamer(params, options), Error);
    options.overlap = 1;
    options.compression = Compression::kPowerSgd;
    EXPECT_THROW(engine.make_streamer(params, options), Error);
    std::vector<int64_t> ints(4);
    EXPECT_THROW(engine.make_streamer({{"i", TensorRef{ints.data(), DType::kInt64, 4, {}}}},
                                      StreamerOptions{}),
                 Error);
  });
}

// Elastic membership (options.confirm): rank 2 dies between two syncs (its
// engine goes, closing its sockets). The survivors' next sync fails; they
// move to an engine of their own, average that sync again from the values
// it was sent from, finish the step and go on: no step is lost, and the run
// is DiLoCo whose second sync averages the two survivors.
TEST(Streamer, SurvivorsAverageTheFailedSyncAgainOverThemselves) {
  const int world = 3;
  const uint64_t steps = 10, dies_after = 6;
  StreamerOptions options;
  options.sync_every = 4;  // syncs after steps 4 and 8; the one at 8 fails
  options.confirm = true;
  auto survivors_store = std::make_shared<MemoryStore>();
  Result got;
  got.live.resize(2);
  got.shared.resize(2);
  std::vector<int> failures_met(2, 0);
  run_ranks(world, [&](Engine& engine) {
    const int rank = engine.rank();
    std::vector<float> a(40, 1.0f), b(24, -0.5f);
    auto streamer = engine.make_streamer(
        {{"a", TensorRef{a.data(), DType::kFloat32, a.size(), {}}},
         {"b", TensorRef{b.data(), DType::kFloat32, b.size(), {}}}},
        options);
    std::unique_ptr<Engine> survivors;
    for (uint64_t s = 1; s <= steps; ++s) {
      for (size_t i = 0; i < a.size(); ++i) a[i] += drift(rank, s, i);
      for (size_t i = 0; i < b.size(); ++i) b[i] += drift(rank, s, 100 + i);
      if (rank == 2 && s == dies_after) return;  // the streamer, then the engine, go
      try {
        streamer->after_inner_step();
      } catch (const Error&) {
        ++failures_met[rank];
        EXPECT_EQ(streamer->inner_steps(), s);      // the step is counted
        EXPECT_EQ(streamer->in_flight_round(), 1u);  // the second sync
        EXPECT_FALSE(streamer->in_flight_averaged());
        survivors = std::make_unique<Engine>(loopback(rank, 2, false), survivors_store);
        streamer->rejoin(*survivors, /*redo=*/true);
        streamer->finish_step();
      }
    }
    record(*streamer, a, b, got, rank);
    EXPECT_EQ(streamer->inner_steps(), steps);
    EXPECT_EQ(streamer->syncs(), 2u);
  }, 30, [](EngineOptions& o) { o.diagnose_failures = false; });  // no wait to name rank 2
  EXPECT_EQ(failures_met, (std::vector<int>{1, 1}));
  for (size_t i = 0; i < 64; ++i) {
    const size_t key = i < 40 ? i : 100 + (i - 40);
    const float start = i < 40 ? 1.0f : -0.5f;
    std::vector<float> live(world, start);
    for (uint64_t s = 1; s <= steps; ++s) {
      const int alive = s < dies_after ? 3 : 2;
      for (int r = 0; r < alive; ++r) live[r] += drift(r, s, key);
      if (s % options.sync_every == 0) {
        float sum = 0.0f;
        for (int r = 0; r < alive; ++r) sum += live[r];
        for (int r = 0; r < alive; ++r) live[r] = sum / alive;
      }
    }
    for (int r = 0; r < 2; ++r) EXPECT_NEAR(got.live[r][i], live[r], 1e-5f) << "element " << i;
    EXPECT_EQ(got.shared[0][i], got.shared[1][i]) << "the shared copy differs";
  }
}

// The same with replica groups of two ranks: group 2 dies (both its ranks);
// the survivors' pieces fail at every place, each group's gather still runs
// and every rank of it raises alike; each place moves to a survivors' engine
// of its own and averages its piece again. Every rank ends bitwise where the
// one-rank-per-group run ends.
TEST(Streamer, SurvivingGroupsAverageTheFailedSyncAgainPieceByPiece) {
  const int groups = 3, ranks = 2;
  const uint64_t steps = 10, dies_after = 6;
  StreamerOptions options;
  options.sync_every = 4;
  options.confirm = true;
  auto run = [&](int places) {
    std::vector<std::vector<float>> shared(groups * places);
    std::vector<std::shared_ptr<MemoryStore>> group_stores, cross_stores, survivor_stores;
    for (int g = 0; g < groups; ++g) group_stores.push_back(std::make_shared<MemoryStore>());
    for (int j = 0; j < places; ++j) {
      cross_stores.push_back(std::make_shared<MemoryStore>());
      survivor_stores.push_back(std::make_shared<MemoryStore>());
    }
    std::vector<std::string> failures(groups * places);
    std::vector<int> raised(groups * places, 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < groups * places; ++r) {
      threads.emplace_back([&, r] {
        try {
          const int g = r / places, j = r % places;
          std::unique_ptr<Engine> group;
          if (places > 1) group = std::make_unique<Engine>(loopback(j, places), group_stores[g]);
          Engine across(loopback(g, groups, false), cross_stores[j]);
          std::vector<float> a(40, 1.0f), b(24, -0.5f);
          auto streamer = across.make_streamer(
              {{"a", TensorRef{a.data(), DType::kFloat32, a.size(), {}}},
               {"b", TensorRef{b.data(), DType::kFloat32, b.size(), {}}}},
              options, group.get());
          std::unique_ptr<Engine> survivors;
          for (uint64_t s = 1; s <= steps; ++s) {
            for (size_t i = 0; i < a.size(); ++i) a[i] += drift(g, s, i);
            for (size_t i = 0; i < b.size(); ++i) b[i] += drift(g, s, 100 + i);
            if (g == 2 && s == dies_after) return;
            try {
              streamer->after_inner_step();
            } catch (const Error&) {
              ++raised[r];
              survivors = std::make_unique<Engine>(loopback(g, 2, false), survivor_stores[j]);
              streamer->rejoin(*survivors, /*redo=*/true);
              streamer->finish_step();
            }
          }
          for (size_t f = 0; f < streamer->fragments().size(); ++f) {
            const TensorRef view = streamer->shared(f);
            const float* data = static_cast<const float*>(view.data);
            shared[r].insert(shared[r].end(), data, data + view.numel);
          }
        } catch (const std::exception& e) {
          failures[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < groups * places; ++r) {
      EXPECT_EQ(failures[r], "") << "rank " << r;
      if (r / places < 2) EXPECT_EQ(raised[r], 1) << "rank " << r;
    }
    return shared;
  };
  const auto alone = run(1);
  const auto grouped = run(ranks);
  ASSERT_EQ(alone[0].size(), 64u);
  EXPECT_EQ(alone[0], alone[1]);
  for (int r = 0; r < 2 * ranks; ++r) EXPECT_EQ(grouped[r], alone[0]) << "rank " << r;
}

// A joining replica takes the run's counts and its live values become the
// shared copy (written first, as a peer's broadcast does).
TEST(Streamer, AdoptTakesTheRunsStateAndTheSharedCopy) {
  run_ranks(1, [](Engine& engine) {
    std::vector<float> a(8, 3.0f);
    StreamerOptions options;
    options.sync_every = 4;
    options.fragments = 2;
    auto streamer = engine.make_streamer(
        {{"a", TensorRef{a.data(), DType::kFloat32, a.size(), {}}}}, options);
    for (size_t f = 0; f < 2; ++f) {
      const TensorRef shared = streamer->shared(f);
      for (size_t i = 0; i < shared.numel; ++i) static_cast<float*>(shared.data)[i] = 7.0f + f;
    }
    streamer->adopt(42, 9, {1, 0});
    EXPECT_EQ(streamer->inner_steps(), 42u);
    EXPECT_EQ(streamer->syncs(), 9u);
    EXPECT_EQ(streamer->momentum_started(), (std::vector<uint8_t>{1, 0}));
    EXPECT_EQ(a, (std::vector<float>{7, 7, 7, 7, 8, 8, 8, 8}));
  });
}

}  // namespace
}  // namespace hemiola
