// Embedding the hemiola engine: N processes rendezvous through a directory
// (FileStore), all-reduce a raw buffer, then reduce "gradients" through a
// Reducer the way a framework's backward pass would.
//
// usage: allreduce_example RANK WORLD_SIZE STORE_DIR
#include <hemiola/hemiola.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s RANK WORLD_SIZE STORE_DIR\n", argv[0]);
    return 2;
  }
  hemiola::EngineOptions options;
  options.rank = std::atoi(argv[1]);
  options.world_size = std::atoi(argv[2]);
  options.hostname = "127.0.0.1";  // all ranks on this machine
  options.timeout_s = 60;
  try {
    hemiola::Engine engine(options, std::make_shared<hemiola::FileStore>(argv[3]));

    // 1. A plain collective on a caller-owned buffer.
    std::vector<float> buffer(1 << 20, static_cast<float>(engine.rank() + 1));
    engine.all_reduce({buffer.data(), hemiola::DType::kFloat32, buffer.size(), {}},
                      hemiola::ReduceOp::kAverage)
        .wait();

    // 2. Gradients fused into buckets and reduced as they become ready.
    std::vector<hemiola::GradSpec> specs = {{hemiola::DType::kFloat32, 1000, "layer0.weight"},
                                            {hemiola::DType::kFloat32, 10, "layer0.bias"},
                                            {hemiola::DType::kFloat64, 500, "layer1.weight"}};
    auto reducer = engine.make_reducer(specs, hemiola::ReducerOptions{});
    std::vector<float> w0(1000, engine.rank() * 2.0f), b0(10, 1.0f);
    std::vector<double> w1(500, engine.rank());
    reducer->mark_ready(2, hemiola::TensorRef{w1.data(), hemiola::DType::kFloat64, w1.size(), {}});
    reducer->mark_ready(1, hemiola::TensorRef{b0.data(), hemiola::DType::kFloat32, b0.size(), {}});
    reducer->mark_ready(0, hemiola::TensorRef{w0.data(), hemiola::DType::kFloat32, w0.size(), {}});
    reducer->wait();

    std::printf("rank %d/%d: allreduce average %.3f, gradients %.3f %.3f %.3f, %zu bucket(s)\n",
                engine.rank(), engine.world_size(), buffer[0], w0[0], b0[0], w1[0],
                reducer->buckets().size());
  } catch (const hemiola::Error& e) {
    std::fprintf(stderr, "rank %d: %s (%s)\n", options.rank, e.what(),
                 hemiola::error_code_name(e.code()));
    return 1;
  }
  return 0;
}
