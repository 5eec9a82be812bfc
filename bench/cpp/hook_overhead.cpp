// Hook-path overhead: the cost of Reducer::mark_ready (copy the gradient into
// its bucket, decrement the bucket's pending count, enqueue a full bucket) for
// 10,000 small parameters, one call timed at a time. Prints one JSON line.
// With `updater`: the mark of priority's hook path instead (Reducer::mark,
// which an Updater observes), each iteration landed by the Updater.
//
// usage: bench_hook_overhead [PARAMS] [ELEMENTS_PER_PARAM] [ITERATIONS] [updater]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "hemiola/hemiola.h"

int main(int argc, char** argv) {
  const size_t params = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 10000;
  const size_t elements = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 16;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 20;
  const bool with_updater = argc > 4 && std::strcmp(argv[4], "updater") == 0;

  hemiola::EngineOptions options;  // one rank: measures the hook path, not the network
  hemiola::Engine engine(options, std::make_shared<hemiola::MemoryStore>());
  std::vector<hemiola::GradSpec> specs(params, {hemiola::DType::kFloat32, elements, "p"});
  hemiola::ReducerOptions reducer_options;  // defaults: 1 MiB first bucket, 25 MiB buckets
  reducer_options.record_order = false;
  if (with_updater) reducer_options.in_flight = 1;  // priority's
  auto reducer = engine.make_reducer(specs, reducer_options);
  std::vector<std::vector<float>> grads(params, std::vector<float>(elements, 1.0f));
  std::vector<std::vector<float>> weights(params, std::vector<float>(elements, 0.5f));
  std::unique_ptr<hemiola::Updater> updater;
  hemiola::StepOptions step;
  if (with_updater) {
    std::vector<hemiola::ParameterSlot> slots(params);
    for (size_t i = 0; i < params; ++i) {
      slots[i].name = "p";
      slots[i].param = hemiola::TensorRef{weights[i].data(), hemiola::DType::kFloat32, elements,
                                          hemiola::Device{}};
    }
    hemiola::UpdaterOptions updater_options;  // priority, the engine's SGD
    updater_options.rebuild_buckets = false;
    updater = std::make_unique<hemiola::Updater>(engine, *reducer, slots, updater_options);
    hemiola::OptimizerHyper hyper;
    hyper.lr = 1e-3;
    step.hyper = {hyper};
  }

  std::vector<double> samples;
  samples.reserve(params * iterations);
  for (int it = 0; it < iterations; ++it) {
    for (size_t k = 0; k < params; ++k) {
      const size_t i = params - 1 - k;  // backward order
      const auto start = std::chrono::steady_clock::now();
      if (updater) {
        reducer->mark(i, grads[i].data(), grads[i].data());
      } else {
        reducer->mark_ready(i, grads[i].data());
      }
      const auto end = std::chrono::steady_clock::now();
      if (it > 0) samples.push_back(std::chrono::duration<double, std::nano>(end - start).count());
    }
    if (updater) {
      updater->step(static_cast<uint64_t>(reducer->finish_marking()), step);
      updater->synchronize();
    } else {
      reducer->wait();
    }
  }
  // Timer resolution/overhead, to subtract mentally: two back-to-back reads.
  std::vector<double> empty;
  for (int i = 0; i < 100000; ++i) {
    const auto a = std::chrono::steady_clock::now();
    const auto b = std::chrono::steady_clock::now();
    empty.push_back(std::chrono::duration<double, std::nano>(b - a).count());
  }
  auto pct = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(q * (v.size() - 1))];
  };
  std::printf(
      "{\"bench\": \"hook_overhead\", \"path\": \"%s\", \"params\": %zu, \"elements_per_param\": %zu, "
      "\"calls\": %zu, \"median_ns\": %.1f, \"p90_ns\": %.1f, \"p99_ns\": %.1f, "
      "\"max_ns\": %.1f, \"timer_overhead_median_ns\": %.1f, \"buckets\": %zu}\n",
      with_updater ? "updater" : "reducer", params, elements, samples.size(), pct(samples, 0.5), pct(samples, 0.9), pct(samples, 0.99),
      pct(samples, 1.0), pct(empty, 0.5), reducer->buckets().size());
  return 0;
}
