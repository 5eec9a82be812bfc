// Parameter server: servers and workers as threads of one process, over real
// Gloo TCP connections on loopback, rendezvousing through a MemoryStore.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <numeric>
#include <thread>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include "comm/gloo_setup.h"
#include "hemiola/ps.h"
#include "hemiola/status.h"
#include "temp_dir.h"
#include "ps/address.h"
#include "ps/channel.h"
#include "ps/connect.h"
#include "ps/log_limit.h"
#include "ps/optimizer.h"
#include "ps/protocol.h"
#include "ps/snapshot.h"
#include "ps/table.h"

using namespace hemiola;
using namespace hemiola::ps;

namespace {

ServerOptions server_options(int index, int servers, int workers, Consistency c) {
  ServerOptions o;
  o.server_index = index;
  o.num_servers = servers;
  o.num_workers = workers;
  o.consistency = c;
  o.timeout_s = 20;
  o.hostname = "127.0.0.1";
  return o;
}

// A server with options `o` serving on a thread of its own until its job
// ends; the future holds its final statistics.
std::future<ServerStats> serve_in_background(const ServerOptions& o,
                                             std::shared_ptr<Store> store) {
  return std::async(std::launch::async, [o, store] {
    Server server(o, store);
    server.serve();
    return server.stats();
  });
}

ClientOptions client_options(int index, int servers, int workers, Consistency c) {
  ClientOptions o;
  o.worker_index = index;
  o.num_servers = servers;
  o.num_workers = workers;
  o.consistency = c;
  o.timeout_s = 20;
  o.hostname = "127.0.0.1";
  o.partition_elems = 4;
  return o;
}

// Runs `servers` servers in threads for the lifetime of the object.
class ServerFleet {
 public:
  ServerFleet(std::shared_ptr<Store> store, int servers, int workers, Consistency c,
              std::string snapshot_dir = "", bool restore = false) {
    for (int s = 0; s < servers; ++s) {
      auto o = server_options(s, servers, workers, c);
      if (!snapshot_dir.empty()) o.snapshot_path = snapshot_dir + "/server" + std::to_string(s);
      o.restore = restore;
      done_.push_back(std::async(std::launch::async, [o, store] {
        Server server(o, store);
        server.serve();
        return server.stats();
      }));
    }
  }
  std::vector<ServerStats> join() {
    std::vector<ServerStats> stats;
    for (auto& f : done_) stats.push_back(f.get());
    return stats;
  }

 private:
  std::vector<std::future<ServerStats>> done_;
};

OptimizerHyper sgd(double lr) {
  OptimizerHyper h;
  h.lr = lr;
  return h;
}

// Runs worker(0) and worker(1) at once, each a client on its own thread;
// returns what each threw ("" for one that finished).
std::array<std::string, 2> errors_of_two_workers(const std::function<void(int)>& worker) {
  auto run = [&](int w) -> std::string {
    try {
      worker(w);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  auto a = std::async(std::launch::async, run, 0);
  auto b = std::async(std::launch::async, run, 1);
  return {a.get(), b.get()};
}


}  // namespace

TEST(ShardPlan, OneHugeTensorBalancesAcrossServers) {
  const auto shards = plan_shards({1000}, 3, 100);
  ASSERT_EQ(shards.size(), 10u);
  std::vector<int64_t> load(3, 0);
  int64_t covered = 0;
  for (const auto& s : shards) {
    EXPECT_EQ(s.begin, covered);  // contiguous, in order
    covered += s.count;
    load[static_cast<size_t>(s.server)] += s.count;
  }
  EXPECT_EQ(covered, 1000);
  EXPECT_EQ(*std::max_element(load.begin(), load.end()), 400);  // 4+3+3 parts of 100
  EXPECT_EQ(*std::min_element(load.begin(), load.end()), 300);
}

TEST(ShardPlan, ManyTinyTensorsAndMoreServersThanTensors) {
  std::vector<int64_t> tiny(50, 3);
  auto shards = plan_shards(tiny, 4, 1 << 20);
  ASSERT_EQ(shards.size(), 50u);
  std::vector<int> per_server(4, 0);
  for (const auto& s : shards) per_server[static_cast<size_t>(s.server)] += 1;
  for (int n : per_server) EXPECT_TRUE(n == 12 || n == 13);

  shards = plan_shards({5, 7}, 5, 1 << 20);
  ASSERT_EQ(shards.size(), 2u);
  EXPECT_NE(shards[0].server, shards[1].server);
  shards = plan_shards({0}, 2, 10);  // an empty tensor still gets a (zero-length) key
  ASSERT_EQ(shards.size(), 1u);
  EXPECT_EQ(shards[0].count, 0);
  EXPECT_THROW(plan_shards({10}, 0, 10), Error);
}

TEST(ServerOptimizer, SgdMomentumFollowsTorch) {
  OptimizerState s;
  std::vector<float> p = {1.0f, -2.0f};
  const std::vector<float> g = {0.5f, 0.25f};
  OptimizerHyper h;
  h.lr = 0.1;
  h.momentum = 0.9;
  h.weight_decay = 0.01;
  optimizer_step(s, p.data(), g.data(), 2, h, PushWeight{});
  // First step: buf = g + wd*p (no dampening), p -= lr*buf.
  const double d0 = 0.5 + 0.01 * 1.0;
  EXPECT_NEAR(p[0], 1.0 - 0.1 * d0, 1e-6);
  const double p0 = 1.0 - 0.1 * d0;
  optimizer_step(s, p.data(), g.data(), 2, h, PushWeight{});
  const double d1 = 0.5 + 0.01 * p0;
  const double buf = 0.9 * d0 + d1;
  EXPECT_NEAR(p[0], p0 - 0.1 * buf, 1e-6);
}

TEST(ServerOptimizer, PushWeightFollowsStaleness) {
  const auto w = push_weight(StalenessRule::kInverse, MomentumRule::kCompensated, 2, 4);
  EXPECT_DOUBLE_EQ(w.lr_scale, 1.0);
  EXPECT_DOUBLE_EQ(w.grad_scale, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(w.momentum_scale, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(w.factor, 1.0 / 3.0);
  const auto zhang = push_weight(StalenessRule::kZhang, MomentumRule::kCompensated, 4, 4);
  EXPECT_DOUBLE_EQ(zhang.grad_scale, 0.25);
  EXPECT_DOUBLE_EQ(zhang.momentum_scale, 0.2);
  const auto classic = push_weight(StalenessRule::kZhang, MomentumRule::kNone, 4, 4);
  EXPECT_DOUBLE_EQ(classic.lr_scale, 0.25);
  EXPECT_DOUBLE_EQ(classic.grad_scale, 1.0);
  EXPECT_DOUBLE_EQ(classic.momentum_scale, 1.0);
  EXPECT_DOUBLE_EQ(classic.factor, zhang.factor);
  // Rescaled over 4 workers: the 3 other pushes of a round are bsp's own
  // staleness; beyond them the factor counts N times over.
  const auto round = push_weight(StalenessRule::kInverse, MomentumRule::kRescaled, 3, 4);
  EXPECT_DOUBLE_EQ(round.grad_scale, 1.0);
  EXPECT_EQ(round.rescale_workers, 4);
  EXPECT_DOUBLE_EQ(round.factor, 0.25);  // Adam's learning rate scale
  const auto straggler = push_weight(StalenessRule::kInverse, MomentumRule::kRescaled, 15, 4);
  EXPECT_DOUBLE_EQ(straggler.grad_scale, 0.25);
  for (const auto rule : {MomentumRule::kNone, MomentumRule::kCompensated,
                          MomentumRule::kRescaled}) {
    const auto fresh = push_weight(StalenessRule::kInverse, rule, 0, 1);
    EXPECT_DOUBLE_EQ(fresh.factor, 1.0);  // bsp and one worker: torch's step exactly
    const auto bogus = push_weight(StalenessRule::kInverse, rule, -5, 1);  // a worker's claim
    EXPECT_DOUBLE_EQ(bogus.factor, 1.0);
    OptimizerHyper h;
    h.lr = 0.1;
    h.momentum = 0.9;
    for (const auto& weight : {fresh, bogus}) {
      const SgdPush p = sgd_push(h, weight);
      EXPECT_DOUBLE_EQ(p.lr, 0.1);
      EXPECT_DOUBLE_EQ(p.momentum, 0.9);
      EXPECT_DOUBLE_EQ(p.grad_scale, 1.0);
    }
  }
}

// Rescaled: N pushes decay the buffer as one bsp round does, and a gradient
// moves the parameters as far as one of the N it is averaged with in a round:
// with the same gradient every time, the parameters move as far per round.
TEST(ServerOptimizer, RescaledPushesMoveAsFarAsBspRounds) {
  for (const double momentum : {0.0, 0.5, 0.9}) {
    for (const int n : {2, 4}) {
      OptimizerHyper h;
      h.lr = 0.01;
      h.momentum = momentum;
      const PushWeight weight =
          push_weight(StalenessRule::kInverse, MomentumRule::kRescaled, n - 1, n);
      const SgdPush p = sgd_push(h, weight);
      EXPECT_NEAR(std::pow(p.momentum, n), momentum, 1e-12);
      OptimizerState bsp, async;
      std::vector<float> x_bsp = {0.0f}, x_async = {0.0f};
      const std::vector<float> g = {1.0f};
      double moved_bsp = 0.0, moved_async = 0.0;
      for (int round = 0; round < 400; ++round) {
        const float before_bsp = x_bsp[0], before_async = x_async[0];
        optimizer_step(bsp, x_bsp.data(), g.data(), 1, h, PushWeight{});  // the average of n gs
        for (int i = 0; i < n; ++i) optimizer_step(async, x_async.data(), g.data(), 1, h, weight);
        moved_bsp = before_bsp - x_bsp[0];
        moved_async = before_async - x_async[0];
      }
      // Per round, in the steady state: lr * g / (1 - momentum) both ways.
      EXPECT_NEAR(moved_bsp, 0.01 / (1.0 - momentum), 1e-4) << momentum << " " << n;
      EXPECT_NEAR(moved_async, moved_bsp, 1e-4 * moved_bsp) << momentum << " " << n;
    }
  }
}

// A stale SGD push with momentum compensation: its gradient and weight decay
// enter the buffer weighted by the factor and the old buffer decays by the
// compensated momentum, so the buffer carries on only that much of them.
TEST(ServerOptimizer, StaleSgdPushWeighsItsGradientAndMomentum) {
  OptimizerState s;
  std::vector<float> p = {1.0f, -2.0f};
  const std::vector<float> g = {0.5f, 0.25f};
  OptimizerHyper h;
  h.lr = 0.1;
  h.momentum = 0.9;
  h.weight_decay = 0.01;
  optimizer_step(s, p.data(), g.data(), 2, h, PushWeight{});
  const double buf0 = 0.5 + 0.01 * 1.0;
  const double p0 = 1.0 - 0.1 * buf0;
  optimizer_step(s, p.data(), g.data(), 2, h,
                 push_weight(StalenessRule::kZhang, MomentumRule::kCompensated, 2, 3));
  const double buf1 = 0.3 * buf0 + 0.5 * (0.5 + 0.01 * p0);
  EXPECT_NEAR(s.m[0], buf1, 1e-6);
  EXPECT_NEAR(p[0], p0 - 0.1 * buf1, 1e-6);
}

TEST(ServerOptimizer, AdamWFollowsTorch) {
  OptimizerState s;
  s.kind = OptimizerKind::kAdamW;
  std::vector<float> p = {0.3f};
  const std::vector<float> g = {0.2f};
  OptimizerHyper h;
  h.lr = 0.01;
  h.weight_decay = 0.1;
  double pd = 0.3, m = 0, v = 0;
  for (int step = 1; step <= 3; ++step) {
    optimizer_step(s, p.data(), g.data(), 1, h, PushWeight{});
    pd *= 1 - 0.01 * 0.1;
    m = 0.9 * m + 0.1 * 0.2;
    v = 0.999 * v + 0.001 * 0.04;
    const double mhat = m / (1 - std::pow(0.9, step));
    const double vhat = v / (1 - std::pow(0.999, step));
    pd -= 0.01 * mhat / (std::sqrt(vhat) + 1e-8);
    EXPECT_NEAR(p[0], pd, 1e-6) << "step " << step;
  }
}

// An eager reply without the requester's push's momentum share: exactly where
// a zero-gradient step (without weight decay) would take the parameters, and
// the optimizer state untouched.
TEST(ServerOptimizer, MomentumShareIsAZeroGradientStep) {
  for (const auto kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    for (const bool nesterov : {false, true}) {
      if (kind != OptimizerKind::kSgd && nesterov) continue;
      OptimizerState s;
      s.kind = kind;
      OptimizerHyper h;
      h.lr = kind == OptimizerKind::kSgd ? 0.1 : 0.01;
      h.momentum = 0.9;
      h.nesterov = nesterov;
      std::vector<float> p = {1.0f, -2.0f, 0.5f};
      const std::vector<float> g = {0.5f, -0.25f, 0.125f};
      std::vector<float> out(3);
      momentum_share_removed(s, p.data(), out.data(), 3, h, PushWeight{});
      EXPECT_EQ(out, p) << "no momentum yet: nothing to remove";
      for (int step = 0; step < 3; ++step)
        optimizer_step(s, p.data(), g.data(), 3, h, PushWeight{});
      const OptimizerState before = s;
      for (const auto rule : {MomentumRule::kNone, MomentumRule::kCompensated,
                              MomentumRule::kRescaled}) {
        const PushWeight stale = push_weight(StalenessRule::kInverse, rule, 1, 2);
        momentum_share_removed(s, p.data(), out.data(), 3, h, stale);
        EXPECT_EQ(s.m, before.m);
        EXPECT_EQ(s.v, before.v);
        EXPECT_EQ(s.step, before.step);
        OptimizerState zero_step = s;
        std::vector<float> expected = p;
        const std::vector<float> zeros(3, 0.0f);
        optimizer_step(zero_step, expected.data(), zeros.data(), 3, h, stale);
        for (int i = 0; i < 3; ++i) {
          EXPECT_NEAR(out[i], expected[i], 1e-6)
              << static_cast<int>(kind) << nesterov << static_cast<int>(rule) << i;
          EXPECT_GT(std::abs(out[i] - p[i]), 1e-4) << "the share is not zero: the check can fail";
        }
      }
    }
  }
}

TEST(LogLimit, AFloodPrintsABoundedNumberOfLinesAndSaysHowManyItDropped) {
  LogLimit limit(3, std::chrono::seconds(10));
  const auto t0 = LogLimit::Clock::now();
  int printed = 0;
  for (int i = 0; i < 100000; ++i) {
    if (!limit.admit("refused " + std::to_string(i), t0 + std::chrono::microseconds(i)).empty())
      ++printed;
  }
  EXPECT_EQ(printed, 3);  // 100,000 refusals in 0.1 s: three lines
  // The next window's first line says what the last one dropped.
  EXPECT_EQ(limit.admit("refused again", t0 + std::chrono::seconds(11)),
            "(99997 more like it not shown) refused again");
  EXPECT_EQ(limit.admit("and again", t0 + std::chrono::seconds(12)), "and again");
}

TEST(Snapshot, RoundTripsAndDetectsCorruption) {
  const tests::TempDir temp("hemiola-ps");
  const std::string& dir = temp.path();
  ServerSnapshot s;
  s.server_index = 1;
  s.num_servers = 2;
  s.table = "optimizer 1\n0 0 0 2 w\n";
  KeySnapshot k;
  k.key = 0;
  k.version = 7;
  k.param = {1.5f, -2.5f};
  k.optimizer.kind = OptimizerKind::kAdam;
  k.optimizer.step = 7;
  k.optimizer.m = {0.1f, 0.2f};
  k.optimizer.v = {0.3f, 0.4f};
  s.keys.push_back(k);
  write_snapshot(dir + "/snap", s);
  const auto r = read_snapshot(dir + "/snap");
  EXPECT_EQ(r.table, s.table);
  ASSERT_EQ(r.keys.size(), 1u);
  EXPECT_EQ(r.keys[0].version, 7);
  EXPECT_EQ(r.keys[0].param, k.param);
  EXPECT_EQ(r.keys[0].optimizer.v, k.optimizer.v);

  {  // flip one byte in the middle
    std::fstream f(dir + "/snap", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    f.put('\x7f');
  }
  try {
    read_snapshot(dir + "/snap");
    FAIL() << "a corrupted snapshot was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corrupted"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_snapshot(dir + "/missing"), Error);

  // Truncated anywhere (the checksum goes with the tail): refused, naming it.
  write_snapshot(dir + "/snap", s);
  std::string whole;
  {
    std::ifstream in(dir + "/snap", std::ios::binary);
    whole.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  for (size_t keep : {size_t(0), size_t(5), size_t(20), whole.size() / 2, whole.size() - 1}) {
    {
      std::ofstream out(dir + "/snap", std::ios::binary | std::ios::trunc);
      out.write(whole.data(), static_cast<std::streamsize>(keep));
    }
    try {
      read_snapshot(dir + "/snap");
      ADD_FAILURE() << "a snapshot truncated to " << keep << " bytes was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("truncated") != std::string::npos ||
                  (keep < 8 && what.find("not a hemiola") != std::string::npos))
          << keep << ": " << what;
      EXPECT_NE(what.find("refusing"), std::string::npos) << what;
    }
  }
  // Every single flipped byte is caught.
  for (size_t at = 0; at < whole.size(); ++at) {
    std::string bad = whole;
    bad[at] = static_cast<char>(bad[at] ^ 0x01);
    {
      std::ofstream out(dir + "/snap", std::ios::binary | std::ios::trunc);
      out.write(bad.data(), static_cast<std::streamsize>(bad.size()));
    }
    EXPECT_THROW(read_snapshot(dir + "/snap"), Error) << "flipped byte " << at;
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Rewrites the snapshot at `path` with `edit` applied to its body, re-sealed
// with a valid checksum: a hand-made file, as an attacker would make it.
void forge(const std::string& path, const std::function<void(std::string&)>& edit) {
  std::string body = read_file(path);
  body.resize(body.size() - sizeof(uint64_t));
  edit(body);
  const uint64_t sum = snapshot_checksum(body);
  body.append(reinterpret_cast<const char*>(&sum), sizeof sum);
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(body.data(), static_cast<std::streamsize>(body.size()));
}

void expect_refused(const std::string& path, const std::string& words) {
  try {
    read_snapshot(path);
    ADD_FAILURE() << "accepted; expected: " << words;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Snapshot, HandMadeFilesWithValidChecksumsAreCheckedFieldByField) {
  const tests::TempDir temp("hemiola-ps");
  const std::string& dir = temp.path();
  const std::string path = dir + "/snap";
  ServerSnapshot s;
  s.num_servers = 1;
  s.table = "t";
  KeySnapshot k;
  k.param = {1.0f, 2.0f};
  k.optimizer.kind = OptimizerKind::kSgd;
  k.optimizer.has_momentum = true;
  k.optimizer.m = {0.5f, 0.5f};
  s.keys.push_back(k);
  write_snapshot(path, s);
  EXPECT_EQ(read_snapshot(path).keys.at(0).param, k.param);
  // The body: prefix (20 bytes), server (4), servers (4), table (8 + 1),
  // key count (8), then the key: key (4), version (8), param count (8) ...
  const size_t key_count = 20 + 4 + 4 + 8 + 1;
  const size_t param_count = key_count + 8 + 4 + 8;
  forge(path, [&](std::string& b) {
    const uint64_t huge = uint64_t{1} << 62;  // * 4 wraps to 0
    std::memcpy(&b[param_count], &huge, sizeof huge);
  });
  expect_refused(path, "claims 4611686018427387904 values");
  write_snapshot(path, s);
  forge(path, [&](std::string& b) {
    const uint64_t many = uint64_t{1} << 40;
    std::memcpy(&b[key_count], &many, sizeof many);
  });
  expect_refused(path, "claims 1099511627776 keys");

  auto bad = s;
  bad.keys[0].optimizer.kind = static_cast<OptimizerKind>(7);
  write_snapshot(path, bad);
  expect_refused(path, "key 0 has optimizer kind 7");
  bad = s;
  bad.keys[0].param[1] = std::nanf("");
  write_snapshot(path, bad);
  expect_refused(path, "key 0 holds a non-finite parameter");
  bad = s;
  bad.keys[0].optimizer.m = {1.0f};
  write_snapshot(path, bad);
  expect_refused(path, "key 0 has 2 parameters but optimizer state of 1");
  bad = s;
  bad.server_index = 3;
  write_snapshot(path, bad);
  expect_refused(path, "is for server 3 of 1");
  bad = s;
  bad.keys.push_back(s.keys[0]);
  write_snapshot(path, bad);
  expect_refused(path, "key 0 is negative or appears twice");
  // Adam before its first step has no moments yet: accepted.
  auto adam = s;
  adam.keys[0].optimizer = OptimizerState{};
  adam.keys[0].optimizer.kind = OptimizerKind::kAdamW;
  write_snapshot(path, adam);
  EXPECT_EQ(read_snapshot(path).keys.at(0).optimizer.kind, OptimizerKind::kAdamW);
}

TEST(Snapshot, ADirectoryIsNamedNotMisread) {
  const tests::TempDir temp("hemiola-ps");
  const std::string& dir = temp.path();
  try {
    read_snapshot(dir);
    FAIL() << "a directory was read as a snapshot";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("snapshot " + dir + " is a directory"),
              std::string::npos) << e.what();
  }
}

TEST(ParameterServer, BspAveragesGradientsAcrossWorkersAndServers) {
  auto store = std::make_shared<MemoryStore>();
  const int servers = 2, workers = 3;
  ServerFleet fleet(store, servers, workers, Consistency::kBsp);
  const std::vector<int64_t> numels = {10, 3};
  std::vector<std::future<std::vector<std::vector<float>>>> results;
  for (int w = 0; w < workers; ++w) {
    results.push_back(std::async(std::launch::async, [&, w] {
      Client c(client_options(w, servers, workers, Consistency::kBsp), {"a", "b"}, numels, store);
      std::vector<std::vector<float>> params = {std::vector<float>(10), std::vector<float>(3)};
      for (size_t t = 0; t < 2; ++t) std::iota(params[t].begin(), params[t].end(), 1.0f);
      std::vector<const float*> init;
      if (w == 0) init = {params[0].data(), params[1].data()};
      c.initialize(init, {sgd(0.5), sgd(0.5)});
      for (int step = 0; step < 3; ++step) {
        for (int t = 0; t < 2; ++t) c.wait_pull(t, params[static_cast<size_t>(t)].data());
        for (int t = 0; t < 2; ++t) {
          std::vector<float> grad(static_cast<size_t>(numels[static_cast<size_t>(t)]),
                                  static_cast<float>(w + 1));
          c.push(t, grad.data());
        }
        for (int t = 0; t < 2; ++t) c.pull(t);
      }
      for (int t = 0; t < 2; ++t) c.wait_pull(t, params[static_cast<size_t>(t)].data());
      for (const auto& r : c.push_records()) EXPECT_EQ(r.staleness, 0);
      c.close();
      return params;
    }));
  }
  for (auto& r : results) {
    const auto params = r.get();
    // Mean gradient 2, lr 0.5, three steps: each element moved by -3.
    for (size_t t = 0; t < 2; ++t)
      for (size_t i = 0; i < params[t].size(); ++i)
        EXPECT_FLOAT_EQ(params[t][i], static_cast<float>(i + 1) - 3.0f);
  }
  for (const auto& s : fleet.join()) EXPECT_EQ(s.rejected, 0);
}

TEST(ParameterServer, WaitPullReportsHowLongItBlocked) {
  // bsp: worker 0's pull waits for the round, which worker 1 ends 200 ms
  // late; a reply that has already arrived is taken without blocking.
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 2, Consistency::kBsp);
  auto worker = [&](int w) {
    Client c(client_options(w, 1, 2, Consistency::kBsp), {"x"}, {4}, store);
    std::vector<float> x(4, 1.0f), g(4, 1.0f);
    c.initialize(w == 0 ? std::vector<const float*>{x.data()} : std::vector<const float*>{},
                 {sgd(0.1)});
    c.wait_pull(0, x.data());
    if (w == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    c.push(0, g.data());
    c.pull(0);
    const double blocked = c.wait_pull(0, x.data());
    if (w == 0) {
      EXPECT_GE(blocked, 0.1);
    }
    c.push(0, g.data());
    c.pull(0);
    while (!c.pull_ready(0)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(c.wait_pull(0, x.data()), 0.0);
    c.close();
  };
  auto w0 = std::async(std::launch::async, worker, 0);
  auto w1 = std::async(std::launch::async, worker, 1);
  w0.get();
  w1.get();
  fleet.join();
}

TEST(ParameterServer, AsyncStalenessMatchesThePushSchedule) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 2, Consistency::kAsp);
  std::promise<void> w0_done_three;
  auto w0_signal = w0_done_three.get_future().share();
  std::promise<void> w1_pulled;
  auto w1_signal = w1_pulled.get_future().share();
  auto worker = [&](int w) {
    auto o = client_options(w, 1, 2, Consistency::kAsp);
    o.staleness_rule = StalenessRule::kInverse;
    Client c(o, {"x"}, {4}, store);
    std::vector<float> x(4, 1.0f), g(4, 1.0f);
    c.initialize(w == 0 ? std::vector<const float*>{x.data()} : std::vector<const float*>{},
                 {sgd(0.1)});
    c.wait_pull(0, x.data());
    if (w == 0) {
      w1_signal.wait();  // worker 1 holds version 0
      for (int i = 0; i < 3; ++i) {
        c.push(0, g.data());
        c.pull(0);
        c.wait_pull(0, x.data());
      }
      c.flush();
      w0_done_three.set_value();
    } else {
      w1_pulled.set_value();
      w0_signal.wait();
      c.push(0, g.data());  // computed on version 0, applied at version 3
      c.flush();
    }
    auto records = c.push_records();
    c.close();
    return records;
  };
  auto r0 = std::async(std::launch::async, worker, 0);
  auto r1 = std::async(std::launch::async, worker, 1);
  const auto rec0 = r0.get();
  const auto rec1 = r1.get();
  ASSERT_EQ(rec0.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(rec0[i].computed_on, static_cast<int64_t>(i));
    EXPECT_EQ(rec0[i].staleness, 0);
    EXPECT_DOUBLE_EQ(rec0[i].lr_factor, 1.0);
  }
  ASSERT_EQ(rec1.size(), 1u);
  EXPECT_EQ(rec1[0].computed_on, 0);
  EXPECT_EQ(rec1[0].applied_at, 3);
  EXPECT_EQ(rec1[0].staleness, 3);
  EXPECT_DOUBLE_EQ(rec1[0].lr_factor, 0.25);
  fleet.join();
}

// The weight of a stale push travels with it: worker 1's push, 3 versions
// stale, steps with its worker's momentum rule (compensated: factor 1/4 on
// its gradient and momentum 0.9/4; none: momentum 0.9 and the factor on the
// step; rescaled: momentum 0.9^(1/2) and bsp's per-gradient weight), and an
// eager pull ahead is answered without the momentum share its push will take
// at the staleness of its previous one.
TEST(ParameterServer, StalePushesStepWithTheirWeight) {
  for (const auto c : {Consistency::kAsp, Consistency::kEager}) {
    for (const auto rule : {MomentumRule::kCompensated, MomentumRule::kNone,
                            MomentumRule::kRescaled}) {
      const bool compensate = rule == MomentumRule::kCompensated;
      auto store = std::make_shared<MemoryStore>();
      ServerFleet fleet(store, 1, 2, c);
      std::promise<void> w1_ready, w0_done, w1_done;
      auto w1_signal = w1_ready.get_future().share();
      auto w0_signal = w0_done.get_future().share();
      auto w1_signal_done = w1_done.get_future().share();
      auto worker = [&](int w) {
        auto o = client_options(w, 1, 2, c);
        o.staleness_rule = StalenessRule::kInverse;
        o.momentum_rule = rule;
        Client client(o, {"x"}, {1}, store);
        std::vector<float> x(1, 1.0f), g(1, 1.0f);
        OptimizerHyper h = sgd(0.1);
        h.momentum = 0.9;
        client.initialize(w == 0 ? std::vector<const float*>{x.data()}
                                 : std::vector<const float*>{},
                          {h});
        client.wait_pull(0, x.data());
        std::vector<float> seen;
        if (w == 0) {
          w1_signal.wait();  // worker 1 holds version 0
          for (int i = 0; i < 3; ++i) {
            client.push(0, g.data());
            client.flush();
            client.pull(0);
            client.wait_pull(0, x.data());
          }
          w0_done.set_value();
          w1_signal_done.wait();
          client.pull(0);  // holds worker 1's push: the next one is fresh
          client.wait_pull(0, x.data());
          client.push(0, g.data());  // fresh: steps with worker 1's stale push in the buffer
          client.flush();
          client.pull(0);
          client.wait_pull(0, x.data());
          seen.push_back(x[0]);
        } else {
          w1_ready.set_value();
          w0_signal.wait();
          client.push(0, g.data());  // computed on version 0, applied at version 3
          client.flush();
          client.pull(0);
          client.wait_pull(0, x.data());
          seen.push_back(x[0]);
          client.pull(0, /*ahead=*/true);  // eager: as if its next push followed
          client.wait_pull(0, x.data());
          seen.push_back(x[0]);
          w1_done.set_value();
        }
        client.close();
        return seen;
      };
      auto r0 = std::async(std::launch::async, worker, 0);
      auto r1 = std::async(std::launch::async, worker, 1);
      const auto seen0 = r0.get();
      const auto seen1 = r1.get();
      ASSERT_EQ(seen1.size(), 2u);
      ASSERT_EQ(seen0.size(), 1u);
      fleet.join();
      // The same pushes replayed through the server's optimizer with the
      // weights push_weight gives 2 workers: the rule travelled with them.
      OptimizerState replay;
      std::vector<float> v(1, 1.0f), share(1);
      const std::vector<float> one(1, 1.0f);
      OptimizerHyper h = sgd(0.1);
      h.momentum = 0.9;
      auto weight = [&](int64_t tau) {
        return push_weight(StalenessRule::kInverse, rule, tau, 2);
      };
      for (int i = 0; i < 3; ++i) optimizer_step(replay, v.data(), one.data(), 1, h, weight(0));
      optimizer_step(replay, v.data(), one.data(), 1, h, weight(3));
      EXPECT_NEAR(seen1[0], v[0], 1e-6) << static_cast<int>(rule);
      momentum_share_removed(replay, v.data(), share.data(), 1, h, weight(3));
      EXPECT_NEAR(seen1[1], c == Consistency::kEager ? share[0] : v[0], 1e-6)
          << static_cast<int>(rule);
      optimizer_step(replay, v.data(), one.data(), 1, h, weight(0));
      EXPECT_NEAR(seen0[0], v[0], 1e-6) << static_cast<int>(rule);
      if (rule == MomentumRule::kRescaled) continue;
      // By hand: three fresh pushes: buf 1, 1.9, 2.71; x 0.9, 0.71, 0.439.
      // Worker 1's, factor 1/4, steps x by the same 0.1 * (0.9/4 * 2.71 + 1/4)
      // either way, but with compensation the buffer keeps only that quarter.
      const double x = 0.439 - 0.1 * (0.225 * 2.71 + 0.25);
      const double buf = compensate ? 0.225 * 2.71 + 0.25 : 0.9 * 2.71 + 1.0;
      EXPECT_NEAR(seen1[0], x, 1e-6) << "compensate " << compensate;
      // Its ahead pull expects its next push 3 stale as well: momentum's share
      // 0.1 * 0.9/4 * buf (compensated) or 0.1/4 * 0.9 * buf, the same again.
      const double ahead = c == Consistency::kEager ? x - 0.1 * 0.225 * buf : x;
      EXPECT_NEAR(seen1[1], ahead, 1e-6) << "compensate " << compensate;
      // Worker 0's next push is fresh, and the buffer differs.
      EXPECT_NEAR(seen0[0], x - 0.1 * (0.9 * buf + 1.0), 1e-6) << "compensate " << compensate;
    }
  }
}

// A hand-driven worker: a raw channel that speaks the protocol directly.
class RawWorker {
 public:
  // heartbeat 0: it never pings, like a worker whose machine vanished.
  RawWorker(std::shared_ptr<Store> store, int worker,
            std::chrono::milliseconds heartbeat = std::chrono::milliseconds(500),
            const std::string& token = "")
      : worker_(worker) {
    channel_ = std::make_unique<Channel>(
        connect_to_server(*store, 0, worker, token, std::chrono::seconds(20), "server 0"),
        "server 0", std::chrono::seconds(20), heartbeat);
  }
  Header header(MessageType type, int32_t key = -1, int64_t version = 0) {
    Header h;
    h.type = static_cast<uint16_t>(type);
    h.worker = worker_;
    h.key = key;
    h.version = version;
    put_hyper(h, sgd(1.0));
    return h;
  }
  static std::vector<char> floats(std::vector<float> v) {
    std::vector<char> out(v.size() * sizeof(float));
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  Header register_header(Consistency c) {
    Header h = header(MessageType::kRegister);
    h.aux = static_cast<int64_t>(c);  // the consistency the worker runs
    return h;
  }
  // Registers the model of one tensor "w" of `numel` elements, as a Client
  // with these settings and partition would.
  void register_model(Consistency c, int64_t numel, int64_t partition,
                      const OptimizerHyper& hyper) {
    const auto shards = plan_shards({numel}, 1, partition);
    std::map<int32_t, OptimizerHyper> settings;
    for (const auto& s : shards) settings[s.key] = hyper;
    const std::string text =
        make_registration(make_table(shards, {"w"}, 0, OptimizerKind::kSgd), settings);
    channel_->send(register_header(c), std::vector<char>(text.begin(), text.end()));
  }
  Header receive(std::vector<char>* payload) {
    Header h;
    EXPECT_TRUE(channel_->receive(&h, payload));
    return h;
  }
  // register_model, then the server's answer, which must be kRegistered.
  void register_and_expect_registered(Consistency c, int64_t numel, int64_t partition,
                                      const OptimizerHyper& hyper) {
    register_model(c, numel, partition, hyper);
    std::vector<char> payload;
    EXPECT_EQ(receive(&payload).type, static_cast<uint16_t>(MessageType::kRegistered));
  }
  Channel& channel() { return *channel_; }

 private:
  int worker_;
  std::unique_ptr<Channel> channel_;
};

TEST(ParameterServer, RejectsMalformedAndOutOfOrderMessagesWithoutApplyingThem) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 1, Consistency::kAsp);
  RawWorker w(store, 0);
  std::vector<char> payload;
  w.register_and_expect_registered(Consistency::kAsp, 2, 1 << 20, sgd(1.0));
  w.channel().send(w.header(MessageType::kInit, 0), RawWorker::floats({1.0f, 2.0f}));

  auto expect_rejected = [&](const std::string& why_fragment) {
    const Header h = w.receive(&payload);
    ASSERT_EQ(h.type, static_cast<uint16_t>(MessageType::kError));
    const std::string text(payload.begin(), payload.end());
    EXPECT_NE(text.find("rejected"), std::string::npos) << text;
    EXPECT_NE(text.find(why_fragment), std::string::npos) << text;
  };
  // A gradient of the wrong size.
  w.channel().send(w.header(MessageType::kPush, 0), RawWorker::floats({5.0f}));
  expect_rejected("expected 8");
  // A key this server does not hold.
  w.channel().send(w.header(MessageType::kPush, 9), RawWorker::floats({5.0f, 5.0f}));
  expect_rejected("no key 9");
  // A gradient "computed" on a version that does not exist yet.
  w.channel().send(w.header(MessageType::kPush, 0, 4), RawWorker::floats({5.0f, 5.0f}));
  expect_rejected("computed on version 4");
  // A replayed (out-of-order) message: a valid checksum but an old sequence number.
  // (Rejected messages do not advance the server's expected sequence number.)
  Header replay = w.header(MessageType::kPush, 0);
  replay.seq = 1;
  replay.payload_bytes = 8;
  replay.checksum = header_checksum(replay);
  w.channel().send_raw(replay, RawWorker::floats({5.0f, 5.0f}));
  expect_rejected("out of order");

  // None of them was applied: the parameters are still the initial values at version 0.
  // (The channel's own counter is behind the server's expectation after the raw
  // messages, so continue with raw, correctly numbered messages.)
  Header pull = w.header(MessageType::kPull, 0);
  pull.seq = 5;  // register, init and three rejected pushes came before
  pull.checksum = header_checksum(pull);
  w.channel().send_raw(pull);
  Header reply = w.receive(&payload);
  ASSERT_EQ(reply.type, static_cast<uint16_t>(MessageType::kPullReply));
  EXPECT_EQ(reply.version, 0);
  std::vector<float> values(2);
  std::memcpy(values.data(), payload.data(), 8);
  EXPECT_EQ(values, (std::vector<float>{1.0f, 2.0f}));
  // A garbled header (right sequence number, wrong checksum) leaves the stream's
  // framing unknown: the server drops the connection, and the worker is dead
  // to it (asp goes on without it; here it was the only one, so serving ends).
  Header garbled = w.header(MessageType::kPush, 0);
  garbled.seq = 6;
  garbled.payload_bytes = 8;
  garbled.checksum = 12345;
  w.channel().send_raw(garbled, RawWorker::floats({5.0f, 5.0f}));
  const auto stats = fleet.join();
  EXPECT_EQ(stats[0].rejected, 4);
  EXPECT_EQ(stats[0].pushes_applied, 0);
  EXPECT_EQ(stats[0].dead_workers, std::vector<int32_t>{0});
  ASSERT_FALSE(stats[0].rejections.empty());
  EXPECT_NE(stats[0].rejections.back().find("checksum"), std::string::npos)
      << stats[0].rejections.back();
}

TEST(ParameterServer, AHeaderClaimingMoreThanTheLargestShardIsDroppedBeforeItsPayload) {
  // A worker holding the token claims a 1 GiB push for a shard of 2 floats
  // and sends 8 bytes. The server must drop it on the header, not allocate
  // and wait for the gigabyte (the protocol alone allows 4 GiB).
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 1, Consistency::kAsp);
  RawWorker w(store, 0);
  std::vector<char> payload;
  w.register_and_expect_registered(Consistency::kAsp, 2, 1 << 20, sgd(1.0));
  Header huge = w.header(MessageType::kPush, 0);
  huge.seq = 1;
  huge.payload_bytes = int64_t(1) << 30;
  huge.checksum = header_checksum(huge);
  const auto start = std::chrono::steady_clock::now();
  w.channel().send_raw(huge, RawWorker::floats({5.0f, 5.0f}));
  const auto stats = fleet.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(stats[0].dead_workers, std::vector<int32_t>{0});
  EXPECT_EQ(stats[0].pushes_applied, 0);
  ASSERT_FALSE(stats[0].rejections.empty());
  EXPECT_NE(stats[0].rejections.back().find("a payload of 1073741824 bytes, over the"),
            std::string::npos)
      << stats[0].rejections.back();
}

TEST(ParameterServer, BspFailsNamingADeadWorkerWhileAspGoesOn) {
  for (Consistency c : {Consistency::kBsp, Consistency::kAsp}) {
    auto store = std::make_shared<MemoryStore>();
    ServerFleet fleet(store, 1, 2, c);
    std::string error;
    {
      // The server connects worker 0, then worker 1: construct them in that order.
      Client healthy(client_options(0, 1, 2, c), {"w"}, {2}, store);
      auto raw = std::make_unique<RawWorker>(store, 1);
      raw->register_model(c, 2, 4, sgd(0.1));
      std::vector<float> x = {1.0f, 1.0f}, g = {1.0f, 1.0f};
      healthy.initialize({x.data()}, {sgd(0.1)});
      healthy.wait_pull(0, x.data());
      raw.reset();  // worker 1 "dies": its connection closes without a goodbye
      try {
        for (int i = 0; i < 3; ++i) {
          healthy.push(0, g.data());
          healthy.pull(0);
          healthy.wait_pull(0, x.data());
        }
        healthy.close();
      } catch (const Error& e) {
        error = e.what();
      }
    }
    if (c == Consistency::kBsp) {
      EXPECT_NE(error.find("worker 1 (rank 2)"), std::string::npos) << error;
      try {
        fleet.join();
        ADD_FAILURE() << "the bsp server did not fail";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kTimeout);
      }
    } else {
      EXPECT_EQ(error, "");
      const auto stats = fleet.join();
      EXPECT_EQ(stats[0].pushes_applied, 3);
      EXPECT_EQ(stats[0].dead_workers, std::vector<int32_t>{1});
    }
  }
}

TEST(ParameterServer, AServerThatFailsToStartTellsItsWorkersWhyAtOnce) {
  // restore=true with no snapshot on disk: the server cannot start. Its
  // worker used to wait out timeout_s and report only a missing store key.
  const tests::TempDir temp("hemiola-ps");
  const std::string& dir = temp.path();
  auto store = std::make_shared<MemoryStore>();
  auto o = server_options(0, 1, 1, Consistency::kAsp);
  o.snapshot_path = dir + "/missing";
  o.restore = true;
  EXPECT_THROW(Server(o, store), Error);
  const auto start = std::chrono::steady_clock::now();
  try {
    Client c(client_options(0, 1, 1, Consistency::kAsp), {"w"}, {3}, store);
    FAIL() << "a worker connected to a server that never started";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("server 0 (rank 0) failed to start: snapshot " + dir + "/missing"),
              std::string::npos) << "got: " << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));  // not 20 s
}

TEST(ParameterServer, RestoresFromSnapshot) {
  const tests::TempDir temp("hemiola-ps");
  const std::string& dir = temp.path();
  std::vector<float> after_first(3);
  {
    auto store = std::make_shared<MemoryStore>();
    ServerFleet fleet(store, 1, 1, Consistency::kAsp, dir);
    auto o = client_options(0, 1, 1, Consistency::kAsp);
    o.optimizer = OptimizerKind::kAdam;
    Client c(o, {"w"}, {3}, store);
    std::vector<float> x = {1, 2, 3}, g = {0.5f, -0.5f, 1.0f};
    c.initialize({x.data()}, {sgd(0.1)});
    c.wait_pull(0, x.data());
    for (int i = 0; i < 2; ++i) {
      c.push(0, g.data());
      c.pull(0);
      c.wait_pull(0, x.data());
    }
    c.snapshot();
    after_first = x;
    c.close();
    fleet.join();
  }
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 1, Consistency::kAsp, dir, /*restore=*/true);
  auto o = client_options(0, 1, 1, Consistency::kAsp);
  o.optimizer = OptimizerKind::kAdam;
  Client c(o, {"w"}, {3}, store);
  std::vector<float> fresh = {9, 9, 9};
  c.initialize({fresh.data()}, {sgd(0.1)});  // ignored: the snapshot wins
  std::vector<float> x(3);
  c.wait_pull(0, x.data());
  EXPECT_EQ(x, after_first);
  // The Adam moments came back too: one more step equals a third uninterrupted step.
  std::vector<float> g = {0.5f, -0.5f, 1.0f};
  c.push(0, g.data());
  c.pull(0);
  c.wait_pull(0, x.data());
  OptimizerState s;
  s.kind = OptimizerKind::kAdam;
  std::vector<float> ref = {1, 2, 3};
  for (int i = 0; i < 3; ++i) optimizer_step(s, ref.data(), g.data(), 3, sgd(0.1), PushWeight{});
  EXPECT_EQ(x, ref);
  c.close();
  fleet.join();
}

TEST(ParameterServer, MismatchedModelsFailAtRegistration) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 2, Consistency::kBsp);
  const auto errors = errors_of_two_workers([&](int w) {
    const int64_t numel = w == 0 ? 3 : 5;
    Client c(client_options(w, 1, 2, Consistency::kBsp), {"w"}, {numel}, store);
    std::vector<float> x(static_cast<size_t>(numel), 1.0f);
    c.initialize(w == 0 ? std::vector<const float*>{x.data()} : std::vector<const float*>{},
                 {sgd(0.1)});
    c.wait_pull(0, x.data());
    c.push(0, x.data());  // a bsp round: worker 0 cannot finish without worker 1
    c.pull(0);
    c.wait_pull(0, x.data());
    c.close();
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("differs"), std::string::npos) << e;
  EXPECT_THROW(fleet.join(), Error);
}

// bsp end to end for a given set of tensors and servers: two workers push
// gradients 1 and 3 for two steps; every element must move by -lr * 2 * 2.
void run_bsp_plan(const std::vector<int64_t>& numels, int servers, int64_t partition) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, servers, 2, Consistency::kBsp);
  std::vector<std::string> names;
  for (size_t t = 0; t < numels.size(); ++t) names.push_back("t" + std::to_string(t));
  auto worker = [&](int w) {
    auto o = client_options(w, servers, 2, Consistency::kBsp);
    o.partition_elems = partition;
    Client c(o, names, numels, store);
    std::vector<std::vector<float>> params;
    std::vector<const float*> init;
    for (auto n : numels) params.emplace_back(static_cast<size_t>(n), 1.0f);
    if (w == 0)
      for (auto& p : params) init.push_back(p.data());
    c.initialize(init, std::vector<OptimizerHyper>(numels.size(), sgd(0.25)));
    for (int step = 0; step < 2; ++step) {
      for (size_t t = 0; t < numels.size(); ++t) {
        c.wait_pull(static_cast<int>(t), params[t].data());
        std::vector<float> g(params[t].size(), w == 0 ? 1.0f : 3.0f);
        c.push(static_cast<int>(t), g.data());
        c.pull(static_cast<int>(t));
      }
    }
    for (size_t t = 0; t < numels.size(); ++t) c.wait_pull(static_cast<int>(t), params[t].data());
    c.close();
    return params;
  };
  auto a = std::async(std::launch::async, worker, 0);
  auto b = std::async(std::launch::async, worker, 1);
  for (const auto& params : {a.get(), b.get()})
    for (const auto& p : params)
      for (float v : p) ASSERT_FLOAT_EQ(v, 1.0f - 0.25f * 2.0f * 2.0f);
  fleet.join();
}

TEST(ParameterServer, ShardingEdgeCasesEndToEnd) {
  run_bsp_plan({1000}, 3, 64);              // one huge tensor over three servers
  run_bsp_plan(std::vector<int64_t>(40, 1), 2, 1 << 20);  // many tiny tensors
  run_bsp_plan({3, 2}, 4, 1 << 20);         // more servers than tensors: two hold nothing
}

TEST(ParameterServer, BspTensorUnusedForRoundsThenUsed) {
  // Tensor b has no gradient in rounds 0 and 1 (push_none by both workers,
  // its pulls never taken), then gets one in rounds 2 and 3: its pushes must
  // join the right rounds and its values come out of the rounds that used it.
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 2, Consistency::kBsp);
  auto worker = [&](int w) {
    Client c(client_options(w, 1, 2, Consistency::kBsp), {"a", "b"}, {2, 2}, store);
    std::vector<float> a(2, 1.0f), b(2, 1.0f), g(2, w == 0 ? 1.0f : 3.0f);
    c.initialize(w == 0 ? std::vector<const float*>{a.data(), b.data()}
                        : std::vector<const float*>{},
                 {sgd(0.25), sgd(0.25)});
    for (int round = 0; round < 4; ++round) {
      const bool b_used = round >= 2;
      c.wait_pull(0, a.data());
      if (b_used || round == 0) c.wait_pull(1, b.data());
      c.push(0, g.data());
      if (b_used) c.push(1, g.data()); else c.push_none(1);
      c.pull(0);
      c.pull(1);
    }
    c.wait_pull(0, a.data());
    c.wait_pull(1, b.data());
    c.close();
    return std::make_pair(a, b);
  };
  auto r0 = std::async(std::launch::async, worker, 0);
  auto r1 = std::async(std::launch::async, worker, 1);
  for (const auto& [a, b] : {r0.get(), r1.get()}) {
    for (float v : a) EXPECT_FLOAT_EQ(v, 1.0f - 4 * 0.25f * 2.0f);  // four rounds
    for (float v : b) EXPECT_FLOAT_EQ(v, 1.0f - 2 * 0.25f * 2.0f);  // two rounds
  }
  for (const auto& s : fleet.join()) EXPECT_EQ(s.rejected, 0);
}

TEST(ParameterServer, ConsistencyMismatchFailsAtRegistration) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 1, Consistency::kBsp);
  std::string error;
  try {
    Client c(client_options(0, 1, 1, Consistency::kAsp), {"w"}, {2}, store);
    std::vector<float> x(2, 1.0f);
    c.initialize({x.data()}, {sgd(0.1)});
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("consistency 'asp' but server 0 runs 'bsp'"), std::string::npos) << error;
  EXPECT_THROW(fleet.join(), Error);
}

TEST(ParameterServer, BspWorkerLeavingEarlyFailsTheOthersAtOnce) {
  // Worker 1 runs one iteration fewer and leaves normally; worker 0's next
  // round must fail at once naming it, not after the timeout.
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 2, Consistency::kBsp);
  const auto started = std::chrono::steady_clock::now();
  const auto errors = errors_of_two_workers([&](int w) {
    Client c(client_options(w, 1, 2, Consistency::kBsp), {"w"}, {2}, store);
    std::vector<float> x(2, 1.0f), g(2, 1.0f);
    c.initialize(w == 0 ? std::vector<const float*>{x.data()} : std::vector<const float*>{},
                 {sgd(0.1)});
    for (int i = 0; i < (w == 0 ? 3 : 2); ++i) {
      c.wait_pull(0, x.data());
      c.push(0, g.data());
      c.pull(0);
    }
    c.wait_pull(0, x.data());
    c.close();
    EXPECT_THROW(c.pull(0), Error);  // closed
  });
  const std::string& e0 = errors[0];
  const std::string& e1 = errors[1];
  EXPECT_EQ(e1, "");
  // Depending on whether worker 0's push or worker 1's goodbye comes first:
  // "... worker 1 (rank 2) already left" or "worker 1 (rank 2) left while ...".
  EXPECT_NE(e0.find("worker 1 (rank 2)"), std::string::npos) << e0;
  EXPECT_NE(e0.find("left"), std::string::npos) << e0;
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));  // timeout 20
  EXPECT_THROW(fleet.join(), Error);
}

TEST(ParameterServer, AWorkerThatFallsSilentIsDeclaredDead) {
  // Worker 1 registers and then sends nothing, not even heartbeats, without
  // closing its connection (its machine vanished). With timeout_s = 2 the asp
  // server must declare it dead and finish once worker 0 leaves; worker 0
  // trains on meanwhile, for longer than the timeout.
  auto store = std::make_shared<MemoryStore>();
  auto o = server_options(0, 1, 2, Consistency::kAsp);
  o.timeout_s = 2;
  auto done = serve_in_background(o, store);
  auto co = client_options(0, 1, 2, Consistency::kAsp);
  co.timeout_s = 2;
  Client healthy(co, {"w"}, {2}, store);
  RawWorker silent(store, 1, std::chrono::milliseconds(0));
  silent.register_model(Consistency::kAsp, 2, 4, sgd(0.1));
  std::vector<float> x = {1.0f, 1.0f}, g = {1.0f, 1.0f};
  healthy.initialize({x.data()}, {sgd(0.1)});
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(3500);
  while (std::chrono::steady_clock::now() < until) {  // idle gaps of 0.3 s: pings keep it alive
    healthy.wait_pull(0, x.data());
    healthy.push(0, g.data());
    healthy.pull(0);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  healthy.wait_pull(0, x.data());
  healthy.close();
  const auto stats = done.get();
  EXPECT_EQ(stats.dead_workers, std::vector<int32_t>{1});
  EXPECT_GE(stats.pushes_applied, 8);
}

namespace {

// A stranger: a plain TCP connection to server 0's published address.
Socket raw_connect(Store& store) {
  const std::string published = store.get(address_key(0), std::chrono::seconds(20));
  const auto space = published.rfind(' ');
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* ai = nullptr;
  EXPECT_EQ(::getaddrinfo(published.substr(0, space).c_str(), published.substr(space + 1).c_str(),
                          &hints, &ai), 0);
  Socket s(::socket(ai->ai_family, SOCK_STREAM, 0));
  EXPECT_EQ(::connect(s.fd(), ai->ai_addr, ai->ai_addrlen), 0);
  ::freeaddrinfo(ai);
  timeval limit{10, 0};  // never a silent hang
  ::setsockopt(s.fd(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  return s;
}

// Reads what the server says to a refused connection: its error text, or ""
// when it only closed.
std::string read_refusal(const Socket& s) {
  Header h;
  size_t got = 0;
  while (got < sizeof h) {
    const ssize_t r = ::recv(s.fd(), reinterpret_cast<char*>(&h) + got, sizeof h - got, 0);
    if (r <= 0) return "";
    got += static_cast<size_t>(r);
  }
  std::string text(static_cast<size_t>(std::min<int64_t>(h.payload_bytes, 4096)), '\0');
  got = 0;
  while (got < text.size()) {
    const ssize_t r = ::recv(s.fd(), text.data() + got, text.size() - got, 0);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  return text;
}

// The admitted worker of a one-tensor job trains: from {1, 2}, one pushed
// gradient of ones under SGD at lr 0.5 pulls back {0.5, 1.5}.
void expect_one_sgd_step(Client& member) {
  std::vector<float> x = {1.0f, 2.0f}, g = {1.0f, 1.0f};
  member.initialize({x.data()}, {sgd(0.5)});
  member.wait_pull(0, x.data());
  member.push(0, g.data());
  member.pull(0);
  member.wait_pull(0, x.data());
  EXPECT_EQ(x, (std::vector<float>{0.5f, 1.5f}));
}

}  // namespace

TEST(ParameterServer, ListensOnTheChosenAddressOnly) {
  BindSpec spec{"lo", "", "", false};
  EXPECT_EQ(bind_address(spec), "127.0.0.1");
  spec = BindSpec{"", "", "127.0.0.1", false};  // the address that routes to the master
  EXPECT_EQ(bind_address(spec), "127.0.0.1");
  spec = BindSpec{"no-such-interface0", "", "", false};
  EXPECT_THROW(bind_address(spec), Error);
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 1, Consistency::kAsp);
  EXPECT_EQ(store->get(address_key(0), std::chrono::seconds(20)).rfind("127.0.0.1 ", 0), 0u);
  Client c(client_options(0, 1, 1, Consistency::kAsp), {"w"}, {2}, store);
  c.close();
  fleet.join();
}

TEST(ParameterServer, JobTokenAdmitsTheJobAndRefusesStrangers) {
  auto store = std::make_shared<MemoryStore>();
  auto o = server_options(0, 1, 1, Consistency::kAsp);
  o.token = "s3cret";
  auto done = serve_in_background(o, store);
  auto co = client_options(0, 1, 1, Consistency::kAsp);
  for (const std::string& token : {std::string("wrong"), std::string("")}) {
    co.token = token;
    try {
      Client stranger(co, {"w"}, {2}, store);
      ADD_FAILURE() << "a client with token '" << token << "' was admitted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted);
      EXPECT_NE(std::string(e.what()).find(token.empty() ? "no job token" : "wrong job token"),
                std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("s3cret"), std::string::npos) << "leaks the token";
    }
  }
  co.token = "s3cret";
  Client member(co, {"w"}, {2}, store);
  expect_one_sgd_step(member);
  // Once the job is complete, even the right token cannot take a second seat.
  try {
    Client late(co, {"w"}, {2}, store);
    ADD_FAILURE() << "a second worker 0 was admitted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already connected"), std::string::npos) << e.what();
  }
  member.close();
  const auto stats = done.get();
  EXPECT_EQ(stats.refused, 3);
  EXPECT_EQ(stats.pushes_applied, 1);
  EXPECT_EQ(stats.rejected, 0);
}

// Guessing the job token: threads send wrong-token hellos as fast as the
// server answers them. Token checks are rate-limited (20 a second), so the
// flood learns little, while a worker holding the token, arriving in the
// middle of it, is admitted at once and trains.
TEST(ParameterServer, TokenGuessingIsThrottledWhileTheWorkerIsAdmitted) {
  using Steady = std::chrono::steady_clock;
  const std::string secret = "s3cret-7f3a";
  auto store = std::make_shared<MemoryStore>();
  auto o = server_options(0, 1, 1, Consistency::kAsp);
  o.token = secret;
  auto done = serve_in_background(o, store);
  store->get(address_key(0), std::chrono::seconds(20));  // listening
  constexpr int kGuessers = 3;
  const auto flood_for = std::chrono::milliseconds(2000);
  const auto start = Steady::now();
  std::vector<std::future<std::vector<std::string>>> guessers;
  for (int t = 0; t < kGuessers; ++t)
    guessers.push_back(std::async(std::launch::async, [&, t] {
      std::vector<std::string> answers;
      for (int i = 0; Steady::now() - start < flood_for; ++i) {
        Socket s = raw_connect(*store);
        const std::string guess = "guess-" + std::to_string(t) + "-" + std::to_string(i);
        const auto hello =
            frame(hello_header(0, guess), std::vector<char>(guess.begin(), guess.end()));
        if (::send(s.fd(), hello.data(), hello.size(), MSG_NOSIGNAL) !=
            static_cast<ssize_t>(hello.size()))
          continue;
        answers.push_back(read_refusal(s));
      }
      return answers;
    }));
  // In the middle of the flood, the worker joins, and trains.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto co = client_options(0, 1, 1, Consistency::kAsp);
  co.token = secret;
  const auto joining = Steady::now();
  Client member(co, {"w"}, {2}, store);
  const auto joined_after = Steady::now() - joining;
  EXPECT_LT(joined_after, std::chrono::milliseconds(1000));
  std::vector<float> x = {1.0f, 2.0f}, g = {1.0f, 1.0f};
  member.initialize({x.data()}, {sgd(0.5)});
  int steps = 0;
  std::vector<double> step_us;
  while (Steady::now() - start < flood_for) {
    const auto step_start = Steady::now();
    member.wait_pull(0, x.data());
    member.push(0, g.data());
    member.pull(0);
    steps += 1;
    step_us.push_back(
        std::chrono::duration<double, std::micro>(Steady::now() - step_start).count());
  }
  std::sort(step_us.begin(), step_us.end());
  member.wait_pull(0, x.data());
  int64_t checks = 0, answered = 0;
  for (auto& f : guessers)
    for (const std::string& text : f.get()) {
      answered += 1;
      if (text.find("wrong job token") != std::string::npos) checks += 1;
      EXPECT_EQ(text.find(secret), std::string::npos) << "leaks the token: " << text;
    }
  const double seconds = std::chrono::duration<double>(Steady::now() - start).count();
  member.close();
  const auto stats = done.get();
  std::printf("%lld wrong-token answers (%lld answers) in %.2f s: %.1f guesses/s; the worker "
              "joined after %.3f s and took %d steps (median %.0f us, p99 %.0f us); refused "
              "%lld\n",
              static_cast<long long>(checks), static_cast<long long>(answered), seconds,
              checks / seconds, std::chrono::duration<double>(joined_after).count(), steps,
              step_us.empty() ? 0.0 : step_us[step_us.size() / 2],
              step_us.empty() ? 0.0 : step_us[step_us.size() * 99 / 100],
              static_cast<long long>(stats.refused));
  EXPECT_GE(checks, 5);  // the flood ran, and was answered
  EXPECT_LE(checks / seconds, 50.0);
  EXPECT_LE(stats.refused / seconds, 50.0);
  EXPECT_GE(steps, 1);
  EXPECT_FLOAT_EQ(x[0], 1.0f - 0.5f * static_cast<float>(steps));
  EXPECT_FLOAT_EQ(x[1], 2.0f - 0.5f * static_cast<float>(steps));
  EXPECT_EQ(stats.pushes_applied, steps);
  EXPECT_TRUE(stats.dead_workers.empty());
  for (const std::string& r : stats.rejections)
    EXPECT_EQ(r.find(secret), std::string::npos) << "leaks the token: " << r;
}

// 80 connections that never speak, opened before the worker: at most 64 wait
// to say hello, each newcomer evicting the one waiting longest, so the worker
// (which says hello at once) is admitted without waiting for them to time out.
TEST(ParameterServer, SilentConnectionsDoNotLockTheWorkerOut) {
  auto store = std::make_shared<MemoryStore>();
  auto o = server_options(0, 1, 1, Consistency::kAsp);
  o.token = "s3cret";
  auto done = serve_in_background(o, store);
  std::vector<Socket> silent;
  for (int i = 0; i < 80; ++i) silent.push_back(raw_connect(*store));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // accepted: they wait
  auto co = client_options(0, 1, 1, Consistency::kAsp);
  co.token = "s3cret";
  const auto joining = std::chrono::steady_clock::now();
  Client member(co, {"w"}, {2}, store);
  EXPECT_LT(std::chrono::steady_clock::now() - joining, std::chrono::milliseconds(1000));
  expect_one_sgd_step(member);
  member.close();
  const auto stats = done.get();
  EXPECT_GE(stats.refused, 80 - 64);
}

TEST(ParameterServer, AConnectionThatNeverSpeaksIsDroppedAfterTimeout) {
  auto store = std::make_shared<MemoryStore>();
  auto o = server_options(0, 1, 1, Consistency::kAsp);
  o.timeout_s = 1;
  auto done = serve_in_background(o, store);
  Socket silent = raw_connect(*store);
  const auto connected = std::chrono::steady_clock::now();
  auto co = client_options(0, 1, 1, Consistency::kAsp);
  co.timeout_s = 1;
  Client member(co, {"w"}, {2}, store);  // admitted at once: the silent one blocks nobody
  std::vector<float> x = {0.0f, 0.0f}, g = {1.0f, 1.0f};
  member.initialize({x.data()}, {sgd(1.0)});
  auto refusal = std::async(std::launch::async, [&] { return read_refusal(silent); });
  int steps = 0;
  while (refusal.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
    member.wait_pull(0, x.data());
    member.push(0, g.data());
    member.pull(0);
    steps += 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto dropped_after = std::chrono::steady_clock::now() - connected;
  const std::string text = refusal.get();
  EXPECT_NE(text.find("said nothing for 1 s"), std::string::npos) << text;
  EXPECT_GE(dropped_after, std::chrono::milliseconds(900));
  EXPECT_LT(dropped_after, std::chrono::milliseconds(3000));
  member.wait_pull(0, x.data());
  member.close();
  EXPECT_EQ(x, std::vector<float>(2, -static_cast<float>(steps)));
  const auto stats = done.get();
  EXPECT_EQ(stats.refused, 1);
  EXPECT_TRUE(stats.dead_workers.empty());
}

TEST(ParameterServer, NonFiniteGradientsAreRefusedNamingTheParameter) {
  for (Consistency c : {Consistency::kAsp, Consistency::kBsp}) {
    auto store = std::make_shared<MemoryStore>();
    ServerFleet fleet(store, 1, 1, c);
    Client w(client_options(0, 1, 1, c), {"encoder.weight", "bias"}, {6, 2}, store);
    std::vector<float> p = {1, 1, 1, 1, 1, 1}, b = {0, 0};
    w.initialize({p.data(), b.data()}, {sgd(0.1), sgd(0.1)});
    w.wait_pull(0, p.data());
    w.wait_pull(1, b.data());
    std::vector<float> bad = {0, 0, 0, 0, 0, std::nanf("")};  // element 5: shard [3, 6)
    std::string error;
    try {
      w.push(0, bad.data());
      w.flush();
    } catch (const Error& e) {
      error = e.what();
    }
    EXPECT_NE(error.find("non-finite gradient for parameter 'encoder.weight'"), std::string::npos)
        << error;
    EXPECT_NE(error.find("(element 5 is nan)"), std::string::npos) << error;
    EXPECT_THROW(w.close(), Error);
    if (c == Consistency::kBsp) {
      EXPECT_THROW(fleet.join(), Error);
    } else {
      const auto stats = fleet.join();
      EXPECT_EQ(stats[0].pushes_applied, 1);  // the finite shard [0, 3) only
    }
  }
}

TEST(ServerOptimizer, SettingsAreCheckedAndComparedByName) {
  OptimizerHyper h = sgd(0.05);
  h.momentum = 0.9;
  EXPECT_EQ(hyper_problem(OptimizerKind::kSgd, h), "");
  h.lr = std::nan("");
  EXPECT_EQ(hyper_problem(OptimizerKind::kSgd, h), "a non-finite lr (nan)");
  h.lr = -0.1;
  EXPECT_EQ(hyper_problem(OptimizerKind::kSgd, h), "an invalid learning rate (lr -0.1)");
  h.lr = 0.05;
  h.nesterov = true;
  h.dampening = 0.1;
  EXPECT_NE(hyper_problem(OptimizerKind::kSgd, h).find("nesterov"), std::string::npos);
  OptimizerHyper adam = sgd(1e-3);
  adam.beta2 = 1.0;
  EXPECT_NE(hyper_problem(OptimizerKind::kAdam, adam).find("beta2 1"), std::string::npos);
  EXPECT_EQ(hyper_problem(OptimizerKind::kSgd, adam), "");  // SGD steps without betas

  OptimizerHyper a = sgd(0.5), b = sgd(0.05);
  a.momentum = b.momentum = 0.9;
  EXPECT_EQ(hyper_mismatch(OptimizerKind::kSgd, a, "worker 1", b, "worker 0"),
            "worker 1 has lr 0.5, worker 0 lr 0.05");
  b.lr = 0.5 + 1e-16 * 0.5 * 4;  // one bit apart: both printed in full
  EXPECT_NE(hyper_mismatch(OptimizerKind::kSgd, a, "worker 1", b, "worker 0").find("0.5000000000"),
            std::string::npos);
  b = a;
  b.beta1 = 0.5;  // not an SGD setting
  EXPECT_EQ(hyper_mismatch(OptimizerKind::kSgd, a, "worker 1", b, "worker 0"), "");
  EXPECT_NE(hyper_mismatch(OptimizerKind::kAdamW, a, "worker 1", b, "worker 0"), "");
}

TEST(ShardTable, ARegistrationCarriesTheTableAndExactSettings) {
  const std::string table = make_table(plan_shards({5, 3}, 1, 4), {"a", "hyper"}, 0,
                                       OptimizerKind::kAdam);
  OptimizerHyper h = sgd(0.1 + 1e-17);  // not a short decimal
  h.beta2 = std::nan("");
  h.nesterov = true;
  const auto parsed = parse_registration(make_registration(table, {{0, h}, {2, sgd(1.0)}}));
  EXPECT_EQ(parsed.table, table);
  ASSERT_EQ(parsed.hyper.size(), 2u);
  EXPECT_EQ(parsed.hyper.at(0).lr, h.lr);
  EXPECT_TRUE(std::isnan(parsed.hyper.at(0).beta2));
  EXPECT_TRUE(parsed.hyper.at(0).nesterov);
  EXPECT_EQ(parsed.hyper.at(2).lr, 1.0);
  EXPECT_THROW(parse_registration(table), Error);  // no settings
  EXPECT_THROW(parse_registration(table + "hyper\n0 0.1 0 0 0 0 0.9 0.999\n"), Error);
  EXPECT_THROW(parse_registration(table + "hyper\n0 0.1 0 0 0 0 0.9 0.999 1e-8 7\n"), Error);
  EXPECT_THROW(parse_registration(table + "hyper\n0 0.1x 0 0 0 0 0.9 0.999 1e-8\n"), Error);
}

TEST(ParameterServer, OptimizerSettingsMustAgreeAcrossWorkers) {
  // At registration: workers with learning rates 0.05 and 0.5 (bsp used to
  // average their gradients and step with whichever pushed last).
  {
    auto store = std::make_shared<MemoryStore>();
    ServerFleet fleet(store, 1, 2, Consistency::kBsp);
    const auto errors = errors_of_two_workers([&](int w) {
      Client c(client_options(w, 1, 2, Consistency::kBsp), {"w"}, {3}, store);
      std::vector<float> x(3, 1.0f), g(3, 1.0f);
      c.initialize(w == 0 ? std::vector<const float*>{x.data()} : std::vector<const float*>{},
                   {sgd(w == 0 ? 0.05 : 0.5)});
      // The first pull may be served before the other worker registers; a
      // bsp round cannot finish without it, so both workers see the refusal.
      c.wait_pull(0, x.data());
      c.push(0, g.data());
      c.pull(0);
      c.wait_pull(0, x.data());
      c.close();
    });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("optimizer settings of parameter 'w' differ"), std::string::npos) << e;
      EXPECT_NE(e.find("lr 0.5"), std::string::npos) << e;
      EXPECT_NE(e.find("lr 0.05"), std::string::npos) << e;
    }
    EXPECT_THROW(fleet.join(), Error);
  }
  // In a bsp round: equal at registration, then one worker's rate changes alone.
  {
    auto store = std::make_shared<MemoryStore>();
    ServerFleet fleet(store, 1, 2, Consistency::kBsp);
    const auto errors = errors_of_two_workers([&](int w) {
      Client c(client_options(w, 1, 2, Consistency::kBsp), {"w"}, {3}, store);
      std::vector<float> x(3, 1.0f), g(3, 1.0f);
      c.initialize(w == 0 ? std::vector<const float*>{x.data()} : std::vector<const float*>{},
                   {sgd(0.05)});
      c.wait_pull(0, x.data());
      if (w == 1) c.set_hyper(0, sgd(0.5));
      c.push(0, g.data());
      c.pull(0);
      c.wait_pull(0, x.data());
      c.close();
    });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("bsp round 0 of 'w' got gradients stepped with different optimizer "
                       "settings: worker "), std::string::npos) << e;
      // Whichever pushed first is named second.
      EXPECT_TRUE(e.find("worker 1 (rank 2) has lr 0.5, worker 0 (rank 1) lr 0.05") !=
                      std::string::npos ||
                  e.find("worker 0 (rank 1) has lr 0.05, worker 1 (rank 2) lr 0.5") !=
                      std::string::npos)
          << e;
    }
    try {
      fleet.join();
      ADD_FAILURE() << "the server did not fail";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("different optimizer settings"), std::string::npos)
          << e.what();
    }
  }
}

// A worker pushing a learning rate the step cannot take (NaN, negative) used
// to lock a bsp round: the step threw after both gradients were counted, and
// the other worker waited timeout_s for "a worker" named by nobody. Now the
// push is refused on arrival, naming its worker, in every mode.
TEST(ParameterServer, AnInvalidPushedSettingIsRefusedNamingItsWorker) {
  for (const double lr : {std::nan(""), -0.1}) {
    for (Consistency c : {Consistency::kBsp, Consistency::kAsp}) {
      auto store = std::make_shared<MemoryStore>();
      ServerFleet fleet(store, 1, 2, c);
      Client honest(client_options(0, 1, 2, c), {"w"}, {2}, store);
      RawWorker raw(store, 1);  // a client refuses such a setting itself: speak the wire
      raw.register_model(c, 2, 4, sgd(0.1));
      std::vector<float> x = {1.0f, 1.0f}, g = {1.0f, 1.0f};
      honest.initialize({x.data()}, {sgd(0.1)});
      honest.wait_pull(0, x.data());
      Header push = raw.header(MessageType::kPush, 0);
      put_hyper(push, sgd(lr));
      const auto started = std::chrono::steady_clock::now();
      raw.channel().send(push, RawWorker::floats(g));
      std::vector<char> payload;
      Header reply;
      do {  // past the registration's answer and the pull replies
        reply = raw.receive(&payload);
      } while (reply.type != static_cast<uint16_t>(MessageType::kError));
      const std::string told(payload.begin(), payload.end());
      EXPECT_NE(told.find("worker 1 (rank 2) pushed a gradient for parameter 'w' with"),
                std::string::npos) << told;
      EXPECT_NE(told.find(std::isnan(lr) ? "a non-finite lr (nan)" : "learning rate (lr -0.1)"),
                std::string::npos) << told;
      std::string error;
      try {
        for (int i = 0; i < 3; ++i) {
          honest.push(0, g.data());
          honest.pull(0);
          honest.wait_pull(0, x.data());
        }
      } catch (const Error& e) {
        error = e.what();
      }
      raw.channel().close();
      if (c == Consistency::kBsp) {  // the round cannot complete: everyone learns why, at once
        EXPECT_NE(error.find("worker 1 (rank 2) pushed a gradient"), std::string::npos) << error;
        EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
        EXPECT_THROW(fleet.join(), Error);
      } else {  // only that push is refused; the honest worker goes on
        EXPECT_EQ(error, "");
        honest.close();
        const auto stats = fleet.join();
        EXPECT_EQ(stats[0].pushes_applied, 3);
        EXPECT_EQ(stats[0].rejected, 1);
      }
    }
  }
}

// A setting that is valid but steps the parameters to infinity (lr 1e30)
// used to leave the blame to whoever pushed next: that gradient was the
// first non-finite one. Now the step that did it fails the job, naming whose
// setting it was.
TEST(ParameterServer, AStepThatMakesTheParametersNonFiniteNamesItsWorker) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 2, Consistency::kAsp);
  // Worker 0 is honest, worker 1 reckless.
  const auto errors = errors_of_two_workers([&](int w) {
    Client c(client_options(w, 1, 2, Consistency::kAsp), {"w"}, {2}, store);
    std::vector<float> x = {1.0f, 1.0f}, g = {1e10f, 1.0f};
    c.initialize(w == 0 ? std::vector<const float*>{x.data()} : std::vector<const float*>{},
                 {sgd(0.1)});
    c.wait_pull(0, x.data());
    if (w == 1) {
      c.set_hyper(0, sgd(1e30));
      c.push(0, g.data());
      c.flush();
    } else {
      for (int i = 0; i < 50; ++i) {
        c.push(0, x.data());
        c.pull(0);
        c.wait_pull(0, x.data());
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    c.close();
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("with the settings of worker 1 (rank 2) (lr 1e+30) made it non-finite "
                     "(element 0 is "), std::string::npos) << e;
    EXPECT_EQ(e.find("worker 0 (rank 1) pushed"), std::string::npos) << e;  // not blamed
  }
  EXPECT_THROW(fleet.join(), Error);
}

// A worker holding the token that asks for replies it never reads used to
// grow the server's send queue without bound (a full copy of the key per
// pull). Now its connection is dropped past the bound, naming it; the others
// go on.
TEST(ParameterServer, AWorkerThatNeverReadsItsRepliesIsDroppedAtTheQueueBound) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 2, Consistency::kAsp);
  constexpr int64_t kNumel = 1 << 20;  // 4 MiB: the bound is 16 + 4 x 4 MiB
  auto o = client_options(0, 1, 2, Consistency::kAsp);
  o.partition_elems = kNumel;
  Client honest(o, {"w"}, {kNumel}, store);
  RawWorker greedy(store, 1);
  greedy.register_model(Consistency::kAsp, kNumel, kNumel, sgd(0.1));
  std::vector<float> x(kNumel, 1.0f), g(kNumel, 0.5f);
  honest.initialize({x.data()}, {sgd(0.1)});
  honest.wait_pull(0, x.data());
  for (int i = 0; i < 40; ++i)  // 160 MiB of replies asked for; none is read
    greedy.channel().send(greedy.header(MessageType::kPull, 0));
  for (int i = 0; i < 3; ++i) {
    honest.push(0, g.data());
    honest.pull(0);
    honest.wait_pull(0, x.data());
  }
  honest.close();
  const auto stats = fleet.join();  // ends: worker 1 was dropped
  EXPECT_EQ(stats[0].dead_workers, std::vector<int32_t>{1});
  ASSERT_FALSE(stats[0].rejections.empty());
  const std::string why = stats[0].rejections.back();
  EXPECT_NE(why.find("worker 1 (rank 2) disconnected: more than 33554432 bytes of messages for "
                     "worker 1 (rank 2) waited to be sent"), std::string::npos) << why;
  EXPECT_EQ(stats[0].pushes_applied, 3);
  // Its connection was reset: whatever it reads now, it ends in an error.
  Header h;
  std::vector<char> payload;
  EXPECT_THROW(
      while (greedy.channel().receive(&h, &payload)) {}, Error);
}

TEST(ParameterServer, PullsWaitingForAnAnswerAreBounded) {
  auto store = std::make_shared<MemoryStore>();
  ServerFleet fleet(store, 1, 1, Consistency::kBsp);
  RawWorker w(store, 0);
  w.register_and_expect_registered(Consistency::kBsp, 2, 4, sgd(0.1));
  std::vector<char> payload;
  w.channel().send(w.header(MessageType::kInit, 0), RawWorker::floats({1.0f, 2.0f}));
  for (int i = 0; i < 9; ++i)  // each waits for version 5, which never comes
    w.channel().send(w.header(MessageType::kPull, 0, 5));
  const Header h = w.receive(&payload);
  ASSERT_EQ(h.type, static_cast<uint16_t>(MessageType::kError));
  const std::string told(payload.begin(), payload.end());
  EXPECT_NE(told.find("more than 8 pulls of 'w' wait for an answer"), std::string::npos) << told;
  w.channel().send(w.header(MessageType::kBye));
  const auto stats = fleet.join();
  EXPECT_EQ(stats[0].rejected, 1);
}
