// Several ranks of the engine as threads of one test process: real Gloo over
// loopback TCP, rendezvous through an in-process MemoryStore.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hemiola/hemiola.h"

namespace hemiola::test {

// Runs body(engine) on `world` threads, one engine per thread, each made
// with options that `configure` may change; returns each rank's failure
// message ("" where it did not throw).
inline std::vector<std::string> ranks_failures(
    int world, const std::function<void(Engine&)>& body, double timeout_s = 30,
    const std::function<void(EngineOptions&)>& configure = nullptr) {
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> failures(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        EngineOptions options;
        options.rank = r;
        options.world_size = world;
        options.hostname = "127.0.0.1";
        options.timeout_s = timeout_s;
        if (configure) configure(options);
        Engine engine(options, store);
        body(engine);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

// ranks_failures(), where a rank that throws fails the test with its message.
inline void run_ranks(int world, const std::function<void(Engine&)>& body,
                      double timeout_s = 30,
                      const std::function<void(EngineOptions&)>& configure = nullptr) {
  const std::vector<std::string> failures = ranks_failures(world, body, timeout_s, configure);
  for (int r = 0; r < world; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

}  // namespace hemiola::test
