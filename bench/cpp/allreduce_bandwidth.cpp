// Engine all-reduce bandwidth against raw Gloo on the same buffer sizes, same
// process, same transport: alternating rounds, median of each. Run one process
// per rank; rank 0 prints JSON lines.
//
// usage: bench_allreduce_bandwidth RANK WORLD STORE_DIR [REPEATS]
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "hemiola/hemiola.h"
#include "median.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s RANK WORLD STORE_DIR [REPEATS]\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int world = std::atoi(argv[2]);
  const std::string dir = argv[3];
  const int repeats = argc > 4 ? std::atoi(argv[4]) : 15;

  hemiola::EngineOptions options;
  options.rank = rank;
  options.world_size = world;
  options.hostname = "127.0.0.1";
  options.timeout_s = 120;
  hemiola::Engine engine(options, std::make_shared<hemiola::FileStore>(dir + "/engine"));

  // Raw Gloo: its own context on the same transport.
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, world);
  hemiola::FileStore(dir + "/raw");  // creates the directory gloo expects
  gloo::rendezvous::FileStore raw_store(dir + "/raw");
  context->connectFullMesh(raw_store, device);

  for (size_t bytes : {size_t(4) << 10, size_t(64) << 10, size_t(1) << 20, size_t(8) << 20,
                       size_t(32) << 20, size_t(128) << 20}) {
    const size_t n = bytes / sizeof(float);
    std::vector<float> a(n, 1.0f), b(n, 1.0f);
    std::vector<double> engine_s, raw_s;
    for (int r = 0; r < repeats + 1; ++r) {
      // Alternate which goes first, so drift affects both alike.
      for (int which = 0; which < 2; ++which) {
        const bool run_engine = (which == 0) == (r % 2 == 0);
        const auto start = std::chrono::steady_clock::now();
        if (run_engine) {
          engine.all_reduce({a.data(), hemiola::DType::kFloat32, n, {}}).wait();
        } else {
          gloo::AllreduceOptions opts(context);
          opts.setOutput(b.data(), n);
          opts.setReduceFunction(
              static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
          gloo::allreduce(opts);
        }
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (r > 0) (run_engine ? engine_s : raw_s).push_back(s);  // r == 0: warm-up
      }
    }
    if (rank == 0) {
      const double e = median(engine_s), g = median(raw_s);
      std::printf(
          "{\"bench\": \"allreduce_bandwidth\", \"world\": %d, \"bytes\": %zu, "
          "\"engine_ms\": %.3f, \"raw_gloo_ms\": %.3f, \"engine_gbps\": %.3f, "
          "\"raw_gloo_gbps\": %.3f, \"engine_vs_raw\": %.3f}\n",
          world, bytes, 1e3 * e, 1e3 * g, 8e-9 * bytes / e, 8e-9 * bytes / g, g / e);
      std::fflush(stdout);
    }
  }
  return 0;
}
