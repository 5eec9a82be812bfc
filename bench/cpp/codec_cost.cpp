// What a coding costs on the host: ranks as threads over loopback Gloo, one
// float32 tensor reduced through a reducer with each coding, alternating
// rounds, the median per coding. Rank 0 prints one JSON line per coding.
//
// usage: bench_codec_cost [WORLD] [MILLION_ELEMENTS] [REPEATS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hemiola/hemiola.h"
#include "median.h"

int main(int argc, char** argv) {
  using namespace hemiola;
  const int world = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t n = static_cast<size_t>((argc > 2 ? std::atof(argv[2]) : 8.4) * 1e6);
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 15;
  const std::vector<std::pair<std::string, Compression>> codings = {
      {"none", Compression::kNone}, {"int8", Compression::kInt8}, {"int4", Compression::kInt4}};
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::vector<double>> ms(codings.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      EngineOptions options;
      options.rank = r;
      options.world_size = world;
      options.hostname = "127.0.0.1";
      Engine engine(options, store);
      std::vector<GradSpec> specs = {{DType::kFloat32, n, "w", 0}};
      std::vector<std::unique_ptr<Reducer>> reducers;
      for (const auto& [name, c] : codings) {
        ReducerOptions ro;
        ro.compression = c;
        ro.fusion_bytes = ro.first_bucket_bytes = n * 4;
        reducers.push_back(engine.make_reducer(specs, ro));
      }
      std::vector<float> g(n);
      for (int it = 0; it < repeats + 2; ++it) {
        for (size_t k = 0; k < codings.size(); ++k) {
          for (size_t i = 0; i < n; ++i) g[i] = 1e-3f * static_cast<float>((i * 7 + r) % 101);
          const auto start = std::chrono::steady_clock::now();
          reducers[k]->mark_ready(0, TensorRef{g.data(), DType::kFloat32, n, {}});
          reducers[k]->wait();
          const double t = std::chrono::duration<double, std::milli>(
                               std::chrono::steady_clock::now() - start).count();
          if (r == 0 && it >= 2) ms[k].push_back(t);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t k = 0; k < codings.size(); ++k) {
    std::printf("{\"coding\": \"%s\", \"world\": %d, \"elements\": %zu, \"median_ms\": %.2f}\n",
                codings[k].first.c_str(), world, n, median(ms[k]));
  }
  return 0;
}
