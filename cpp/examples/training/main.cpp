// Data-parallel training of a two-layer linear network from C++, with the
// schedule doing what hemiola's Python wrapper does for a torch model:
// gradients are marked as "backward" produces them, optimizer.step() becomes
// Updater::step(), and each layer's forward first calls Updater::land() for
// the parameters it reads (its "gate").
//
//   usage: training_example RANK WORLD_SIZE STORE_DIR SCHEDULE [STEPS]
//   SCHEDULE: priority | decoupled | sync (wait for the reduction, then step:
//   what DDP does; priority must match it exactly)
//
// Prints the loss every 10 steps and, at the end, a checksum of the exact
// parameters (identical on every rank).
#include <hemiola/hemiola.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kIn = 16, kHidden = 8, kOut = 4, kBatch = 32;

// y = W2 (W1 x + b1) + b2, parameters in this order (the reducer's too).
struct Network {
  std::vector<std::vector<float>> params{std::vector<float>(kHidden * kIn),
                                         std::vector<float>(kHidden),
                                         std::vector<float>(kOut * kHidden),
                                         std::vector<float>(kOut)};
  std::vector<std::vector<float>> grads = params;
  std::vector<std::vector<float>> momentum = params;
  std::vector<float> hidden = std::vector<float>(kBatch * kHidden);

  Network() {
    std::mt19937 rng(42);  // the same initial values on every rank
    std::normal_distribution<float> normal(0.0f, 0.3f);
    for (auto& p : params) {
      for (auto& v : p) v = normal(rng);
    }
  }

  // Forward of layer 1 (h = W1 x + b1) and layer 2 (y = W2 h + b2); returns y.
  std::vector<float> layer1(const std::vector<float>& x) {
    for (int n = 0; n < kBatch; ++n) {
      for (int j = 0; j < kHidden; ++j) {
        float s = params[1][j];
        for (int i = 0; i < kIn; ++i) s += params[0][j * kIn + i] * x[n * kIn + i];
        hidden[n * kHidden + j] = s;
      }
    }
    return hidden;
  }
  std::vector<float> layer2() const {
    std::vector<float> y(kBatch * kOut);
    for (int n = 0; n < kBatch; ++n) {
      for (int k = 0; k < kOut; ++k) {
        float s = params[3][k];
        for (int j = 0; j < kHidden; ++j) s += params[2][k * kHidden + j] * hidden[n * kHidden + j];
        y[n * kOut + k] = s;
      }
    }
    return y;
  }
};

// A batch of this rank's data: targets from a fixed linear map plus noise.
void batch(int rank, int step, std::vector<float>& x, std::vector<float>& t) {
  std::mt19937 rng(1000 * step + rank);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  x.resize(kBatch * kIn);
  t.assign(kBatch * kOut, 0.0f);
  for (auto& v : x) v = normal(rng);
  for (int n = 0; n < kBatch; ++n) {
    for (int k = 0; k < kOut; ++k) {
      for (int i = 0; i < kIn; ++i) {
        t[n * kOut + k] += std::sin(1.0f + k * kIn + i) * x[n * kIn + i];
      }
      t[n * kOut + k] += 0.01f * normal(rng);
    }
  }
}

hemiola::OptimizerHyper hyper(int step) {
  hemiola::OptimizerHyper h;
  h.lr = 0.05 * (step < 50 ? 1.0 : 0.5);  // a step schedule
  h.momentum = 0.9;
  h.weight_decay = 1e-4;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s RANK WORLD_SIZE STORE_DIR priority|decoupled|sync [STEPS]\n",
                 argv[0]);
    return 2;
  }
  const std::string schedule = argv[4];
  const int steps = argc > 5 ? std::atoi(argv[5]) : 100;
  if (schedule != "priority" && schedule != "decoupled" && schedule != "sync") {
    std::fprintf(stderr, "unknown schedule '%s'\n", schedule.c_str());
    return 2;
  }
  hemiola::EngineOptions options;
  options.rank = std::atoi(argv[1]);
  options.world_size = std::atoi(argv[2]);
  options.hostname = "127.0.0.1";
  options.timeout_s = 60;
  try {
    hemiola::Engine engine(options, std::make_shared<hemiola::FileStore>(argv[3]));
    Network net;
    std::vector<hemiola::GradSpec> specs;
    std::vector<hemiola::ParameterSlot> slots;
    const char* names[] = {"layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias"};
    for (size_t p = 0; p < net.params.size(); ++p) {
      specs.push_back({hemiola::DType::kFloat32, net.params[p].size(), names[p]});
      hemiola::ParameterSlot slot;
      slot.name = names[p];
      slot.param = {net.params[p].data(), hemiola::DType::kFloat32, net.params[p].size(), {}};
      slot.momentum_buffer = net.momentum[p].data();
      slots.push_back(slot);
    }
    hemiola::ReducerOptions reducer_options;
    reducer_options.fusion_bytes = 256;  // a few buckets, to have something to overlap
    reducer_options.record_order = true;
    reducer_options.in_flight = 1;  // one iteration reduces while the next computes
    auto reducer = engine.make_reducer(specs, reducer_options);

    std::unique_ptr<hemiola::Updater> updater;
    if (schedule != "sync") {
      hemiola::UpdaterOptions u;
      u.schedule = schedule == "priority" ? hemiola::UpdateSchedule::kPriority
                                          : hemiola::UpdateSchedule::kDecoupled;
      u.optimizer = hemiola::OptimizerKind::kSgd;
      updater = std::make_unique<hemiola::Updater>(engine, *reducer, slots, u);
      // Gate 0 is every parameter; layer 1 reads 0 and 1, layer 2 reads 2 and 3.
      updater->set_gates({{0, 1, 2, 3}, {0, 1}, {2, 3}});
    }

    std::vector<float> x, t;
    for (int step = 0; step < steps; ++step) {
      batch(engine.rank(), step, x, t);
      // Forward, each layer landing what it reads first.
      if (updater) updater->land(1, true);
      net.layer1(x);
      if (updater) updater->land(2, true);
      const std::vector<float> y = net.layer2();
      // Loss 0.5 * mean over the batch of |y - t|^2, and backward (layer 2
      // first, marking each gradient as soon as it is complete).
      double loss = 0.0;
      std::vector<float> dy(y.size());
      for (size_t i = 0; i < y.size(); ++i) {
        const float d = y[i] - t[i];
        loss += 0.5 * d * d / kBatch;
        dy[i] = d / kBatch;
      }
      for (auto& g : net.grads) std::fill(g.begin(), g.end(), 0.0f);
      std::vector<float> dh(kBatch * kHidden, 0.0f);
      for (int n = 0; n < kBatch; ++n) {
        for (int k = 0; k < kOut; ++k) {
          net.grads[3][k] += dy[n * kOut + k];
          for (int j = 0; j < kHidden; ++j) {
            net.grads[2][k * kHidden + j] += dy[n * kOut + k] * net.hidden[n * kHidden + j];
            dh[n * kHidden + j] += net.params[2][k * kHidden + j] * dy[n * kOut + k];
          }
        }
      }
      auto mark = [&](size_t p) {
        if (updater) {
          reducer->mark(p, net.grads[p].data(), net.grads[p].data());  // the updater lands it
        } else {
          reducer->mark_ready(p, net.grads[p].data());  // averaged in place
        }
      };
      mark(3);
      mark(2);
      for (int n = 0; n < kBatch; ++n) {
        for (int j = 0; j < kHidden; ++j) {
          net.grads[1][j] += dh[n * kHidden + j];
          for (int i = 0; i < kIn; ++i) {
            net.grads[0][j * kIn + i] += dh[n * kHidden + j] * x[n * kIn + i];
          }
        }
      }
      mark(1);
      mark(0);
      const auto iteration = static_cast<uint64_t>(reducer->finish_marking());
      // optimizer.step()
      if (updater) {
        hemiola::StepOptions s;
        s.hyper = {hyper(step)};
        updater->step(iteration, s);
      } else {
        reducer->wait(iteration);
        const hemiola::OptimizerHyper h = hyper(step);
        hemiola::SgdHyper sgd{h};
        sgd.first_step = step == 0;
        for (size_t p = 0; p < net.params.size(); ++p) {
          hemiola::sgd_step({net.params[p].data(), net.params[p].data(), net.momentum[p].data(),
                             net.grads[p].data()},
                            static_cast<std::int64_t>(net.params[p].size()),
                            hemiola::DType::kFloat32, {}, sgd, true);
        }
      }
      if (step % 10 == 0 || step == steps - 1) {
        std::printf("rank %d step %d loss %.6f\n", engine.rank(), step, loss);
      }
    }
    if (updater) updater->synchronize();  // the exact parameters
    double checksum = 0.0;
    for (const auto& p : net.params) {
      for (float v : p) checksum = checksum * 1.000001 + v;
    }
    std::printf("rank %d %s checksum %.17g", engine.rank(), schedule.c_str(), checksum);
    if (updater && schedule == "decoupled") {
      std::printf(" approximate reads %.2f", updater->approximate_read_fraction());
    }
    std::printf("\n");
  } catch (const hemiola::Error& e) {
    std::fprintf(stderr, "rank %d: %s (%s)\n", options.rank, e.what(),
                 hemiola::error_code_name(e.code()));
    return 1;
  }
  return 0;
}
