// The Updater (hemiola/updater.h) with ranks as threads over real Gloo: the
// priority schedule equals synchronous SGD / Adam step for step, decoupled
// lands the same exact parameters, and misuse fails with a message.
//
// The "model" is a quadratic per rank, loss_r(w) = 0.5 * |w - t_r|^2, so the
// gradient is w - t_r and the averaged gradient w - mean(t). Two ranks: a sum
// of two floats is the same in any order, so results are bitwise comparable.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hemiola/hemiola.h"
#include "run_ranks.h"

namespace hemiola {
namespace {

constexpr int kWorld = 2;

void run_ranks(const std::function<void(Engine&)>& body) { test::run_ranks(kWorld, body); }

// Three float32 parameters of different sizes, with optimizer state.
struct Model {
  std::vector<std::vector<float>> w, grad, momentum, exp_avg, exp_avg_sq;
  std::vector<float> step;
  explicit Model(int rank) {
    for (size_t n : {300u, 7u, 1000u}) {
      std::vector<float> values(n);
      for (size_t i = 0; i < n; ++i) values[i] = 0.01f * static_cast<float>(i % 17);
      w.push_back(values);
      grad.emplace_back(n);
      momentum.emplace_back(n);
      exp_avg.emplace_back(n);
      exp_avg_sq.emplace_back(n);
    }
    step.assign(w.size(), 0.0f);
    (void)rank;
  }
  std::vector<GradSpec> specs() const {
    std::vector<GradSpec> out;
    for (size_t i = 0; i < w.size(); ++i) {
      out.push_back({DType::kFloat32, w[i].size(), "p" + std::to_string(i)});
    }
    return out;
  }
  std::vector<ParameterSlot> slots() {
    std::vector<ParameterSlot> out;
    for (size_t i = 0; i < w.size(); ++i) {
      ParameterSlot s;
      s.name = "p" + std::to_string(i);
      s.param = TensorRef{w[i].data(), DType::kFloat32, w[i].size(), {}};
      s.momentum_buffer = momentum[i].data();
      s.exp_avg = exp_avg[i].data();
      s.exp_avg_sq = exp_avg_sq[i].data();
      s.step = &step[i];
      out.push_back(s);
    }
    return out;
  }
  // This rank's gradient at the current (live) parameters, iteration k
  // (`identical`: every rank's is rank 0's).
  void backward(int rank, int k, bool identical = false) {
    if (identical) rank = 0;
    for (size_t p = 0; p < w.size(); ++p) {
      for (size_t i = 0; i < w[p].size(); ++i) {
        const float target = static_cast<float>(rank + 1) * 0.1f * static_cast<float>(k % 3 + 1);
        grad[p][i] = w[p][i] - target + 0.001f * static_cast<float>(i % 5);
      }
    }
  }
};

OptimizerHyper sgd_hyper(int k) {
  OptimizerHyper h;
  h.lr = 0.1 / (1 + k);  // changes every step, as an LR scheduler would
  h.momentum = 0.9;
  h.weight_decay = 0.01;
  return h;
}

OptimizerHyper adam_hyper(int k) {
  OptimizerHyper h;
  h.lr = 0.01 / (1 + k);
  h.weight_decay = 0.1;
  return h;
}

ReducerOptions reducer_options(size_t in_flight = 1) {
  ReducerOptions o;
  o.fusion_bytes = 2048;  // several buckets
  o.record_order = true;
  o.in_flight = in_flight;
  return o;
}

// Synchronous data parallelism, by hand: wait for the averaged gradients,
// then one committed optimizer step per parameter.
std::vector<std::vector<float>> reference(Engine& e, OptimizerKind kind, int steps,
                                          bool identical = false) {
  Model m(e.rank());
  auto reducer = e.make_reducer(m.specs(), reducer_options());
  for (int k = 0; k < steps; ++k) {
    m.backward(e.rank(), k, identical);
    for (size_t p = m.w.size(); p-- > 0;) reducer->mark_ready(p, m.grad[p].data());
    reducer->wait();
    for (size_t p = 0; p < m.w.size(); ++p) {
      const auto n = static_cast<std::int64_t>(m.w[p].size());
      if (kind == OptimizerKind::kSgd) {
        const OptimizerHyper g = sgd_hyper(k);
        SgdHyper h{g};
        h.first_step = k == 0;
        sgd_step({m.w[p].data(), m.w[p].data(), m.momentum[p].data(), m.grad[p].data()}, n,
                 DType::kFloat32, Device{}, h, true);
      } else {
        const OptimizerHyper g = adam_hyper(k);
        AdamHyper h{g};
        h.decoupled_weight_decay = true;
        h.step = k + 1;
        adam_step({m.w[p].data(), m.w[p].data(), m.exp_avg[p].data(), m.exp_avg_sq[p].data(),
                   m.grad[p].data()},
                  n, DType::kFloat32, Device{}, h, true);
      }
    }
  }
  return m.w;
}

// SGD with momentum as an external stepper (hemiola's Python layer runs
// torch's step there): in place on the model's live parameters, with momentum
// buffers of its own and a scratch copy of them for local steps; the
// hyper-parameters of step k are sgd_hyper(k) (the key is k).
class ExternalSgd final : public ExternalStepper {
 public:
  explicit ExternalSgd(Model& m) : m_(m) {
    for (const auto& w : m.w) momentum_.emplace_back(w.size(), 0.0f);
    scratch_ = momentum_;
    initialised_.assign(m.w.size(), 0);
    scratch_initialised_ = initialised_;
  }

  void step(const std::vector<size_t>& indices, const std::vector<TensorRef>& grads,
            uint64_t hyper_key, double grad_scale, StepMode mode) override {
    for (size_t k = 0; k < indices.size(); ++k) {
      const size_t i = indices[k];
      EXPECT_EQ(grads[k].numel, m_.w[i].size());
      if (mode == StepMode::kLocal) {
        scratch_[i] = momentum_[i];
        scratch_initialised_[i] = initialised_[i];
      }
      const bool scratch = mode != StepMode::kCommit;
      std::vector<float>& state = scratch ? scratch_[i] : momentum_[i];
      uint8_t& initialised = scratch ? scratch_initialised_[i] : initialised_[i];
      const OptimizerHyper g = sgd_hyper(static_cast<int>(hyper_key));
      SgdHyper h{g};
      h.first_step = initialised == 0;
      h.grad_scale = grad_scale;
      float* w = m_.w[i].data();
      sgd_step({w, w, state.data(), grads[k].data}, static_cast<std::int64_t>(m_.w[i].size()),
               DType::kFloat32, Device{}, h, true);
      initialised = 1;
    }
  }

 private:
  Model& m_;
  std::vector<std::vector<float>> momentum_, scratch_;
  std::vector<uint8_t> initialised_, scratch_initialised_;
};

// The same training through an Updater: marks in backward order, step(),
// then the next "forward" lands parameter 0, then 1, then 2 (three gates).
std::vector<std::vector<float>> with_updater(Engine& e, UpdateSchedule schedule,
                                             OptimizerKind kind, int steps,
                                             bool correct_on_arrival, double* approx = nullptr,
                                             size_t in_flight = 1, bool identical = false,
                                             Model* external = nullptr) {
  Model own(e.rank());
  Model& m = external ? *external : own;
  auto reducer = e.make_reducer(m.specs(), reducer_options(in_flight));
  UpdaterOptions options;
  options.schedule = schedule;
  options.optimizer = kind;
  options.correct_on_arrival = correct_on_arrival;
  if (external) options.external = std::make_shared<ExternalSgd>(m);
  Updater updater(e, *reducer, m.slots(), options);
  updater.set_gates({{0, 1, 2}, {0}, {1}, {2}});
  for (int k = 0; k < steps; ++k) {
    if (k > 0) {
      for (size_t gate = 1; gate <= 3; ++gate) updater.land(gate, true);
    }
    m.backward(e.rank(), k, identical);
    for (size_t p = m.w.size(); p-- > 0;) reducer->mark(p, m.grad[p].data(), m.grad[p].data());
    const auto iteration = static_cast<uint64_t>(reducer->finish_marking());
    StepOptions step;
    step.hyper = {kind == OptimizerKind::kSgd ? sgd_hyper(k) : adam_hyper(k)};
    step.hyper_key = static_cast<uint64_t>(k);
    updater.step(iteration, step);
  }
  updater.synchronize();
  if (approx) *approx = updater.approximate_read_fraction();
  return m.w;
}

TEST(Updater, PriorityEqualsSynchronousSgdAndAdam) {
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
    run_ranks([&](Engine& e) {
      const auto expected = reference(e, kind, 6);
      const auto got = with_updater(e, UpdateSchedule::kPriority, kind, 6, true);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t p = 0; p < got.size(); ++p) {
        EXPECT_EQ(std::memcmp(got[p].data(), expected[p].data(), got[p].size() * 4), 0)
            << "parameter " << p;
      }
    });
  }
}

TEST(Updater, AveragedGradientsAreReadableBeforeTheStepPartitionedOnesToo) {
  // clip_grad_norm_'s value read before optimizer.step() (priority): every
  // averaged gradient, whole or in pieces over several buckets, once the
  // reducer waited. Two ranks: (a + b) * 0.5 is exact in any order.
  run_ranks([&](Engine& e) {
    Model m(e.rank());
    ReducerOptions ro = reducer_options();
    ro.partition_bytes = 1024;  // parameter 2 (4000 bytes) in pieces
    auto reducer = e.make_reducer(m.specs(), ro);
    ASSERT_GT(reducer->pieces(2), 1u);
    UpdaterOptions options;
    options.schedule = UpdateSchedule::kPriority;
    options.optimizer = OptimizerKind::kSgd;
    Updater updater(e, *reducer, m.slots(), options);
    updater.set_gates({{0, 1, 2}});
    for (int k = 0; k < 3; ++k) {
      if (k > 0) updater.land(0, true);
      Model peer = m;
      peer.backward(1 - e.rank(), k);
      m.backward(e.rank(), k);
      for (size_t p = m.w.size(); p-- > 0;) reducer->mark(p, m.grad[p].data(), m.grad[p].data());
      const auto iteration = static_cast<uint64_t>(reducer->finish_marking());
      reducer->wait(iteration);
      for (size_t p = 0; p < m.w.size(); ++p) {
        const TensorRef averaged = updater.averaged(iteration, p);
        ASSERT_EQ(averaged.numel, m.w[p].size());
        const auto* got = static_cast<const float*>(averaged.data);
        for (size_t i = 0; i < m.w[p].size(); ++i) {
          ASSERT_EQ(got[i], (m.grad[p][i] + peer.grad[p][i]) * 0.5f)
              << "parameter " << p << " element " << i << " iteration " << k;
        }
      }
      StepOptions step;
      step.hyper = {sgd_hyper(k)};
      step.hyper_key = static_cast<uint64_t>(k);
      updater.step(iteration, step);
    }
    updater.synchronize();
  });
}

TEST(Updater, DecoupledLandsExactParametersIdenticalOnEveryRank) {
  // With landings only in step() the run does not depend on network timing:
  // run it twice and on both ranks; every copy must be bitwise identical.
  std::vector<std::vector<std::vector<float>>> runs(2 * kWorld);
  std::vector<double> approx(kWorld);
  for (int run = 0; run < 2; ++run) {
    run_ranks([&](Engine& e) {
      runs[run * kWorld + e.rank()] =
          with_updater(e, UpdateSchedule::kDecoupled, OptimizerKind::kSgd, 6, false,
                       &approx[e.rank()]);
    });
  }
  for (size_t c = 1; c < runs.size(); ++c) EXPECT_EQ(runs[c], runs[0]) << "copy " << c;
  // Every forward after the first read approximate values (nothing landed early).
  EXPECT_GT(approx[0], 0.99);
  // And training moved the parameters towards the averaged targets.
  EXPECT_NE(runs[0][0][0], 0.0f);
}

TEST(Updater, DecoupledWithSeveralIterationsInFlightEqualsSynchronousOnIdenticalData) {
  // Every rank's gradient is the average, so each local step is the exact
  // one: however many iterations are pending and whenever they land, the
  // run must be synchronous training bitwise. It exercises the re-taken
  // local steps (an older iteration lands under newer ones) through the
  // scratch state, with momentum and Adam's moments.
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
    for (size_t in_flight : {2u, 3u}) {
      for (bool on_arrival : {true, false}) {
        run_ranks([&](Engine& e) {
          const auto expected = reference(e, kind, 8, /*identical=*/true);
          double approx = 0.0;
          const auto got = with_updater(e, UpdateSchedule::kDecoupled, kind, 8, on_arrival,
                                        &approx, in_flight, /*identical=*/true);
          for (size_t p = 0; p < got.size(); ++p) {
            EXPECT_EQ(std::memcmp(got[p].data(), expected[p].data(), got[p].size() * 4), 0)
                << "parameter " << p << ", in_flight " << in_flight << ", on arrival "
                << on_arrival;
          }
          if (!on_arrival) EXPECT_GT(approx, 0.99);
        });
      }
    }
  }
}

TEST(Updater, DecoupledWithTwoInFlightLagsFurtherButStaysIdenticalOnEveryRank) {
  // Different data per rank, landings only where in_flight forces them: the
  // ranks' exact parameters are bitwise identical, and the trajectory is not
  // in_flight 1's (the approximation lags one more iteration).
  std::vector<std::vector<std::vector<float>>> two(kWorld), one(kWorld);
  run_ranks([&](Engine& e) {
    two[e.rank()] = with_updater(e, UpdateSchedule::kDecoupled, OptimizerKind::kAdamW, 8, false,
                                 nullptr, 2);
    one[e.rank()] = with_updater(e, UpdateSchedule::kDecoupled, OptimizerKind::kAdamW, 8, false);
  });
  EXPECT_EQ(two[1], two[0]);
  EXPECT_NE(two[0], one[0]);
}

TEST(Updater, AnExternalStepperLandsWhatTheEnginesStepperLands) {
  // The landing graph is the same whatever steps: the same SGD taken through
  // an external stepper gives the engine's result bitwise, under priority
  // and decoupled (re-taken local chains with in_flight 2 and 3), on
  // identical and on different data.
  struct Case {
    UpdateSchedule schedule;
    size_t in_flight;
    bool identical;
  };
  for (const Case c : {Case{UpdateSchedule::kPriority, 1, false},
                       Case{UpdateSchedule::kDecoupled, 1, false},
                       Case{UpdateSchedule::kDecoupled, 2, true},
                       Case{UpdateSchedule::kDecoupled, 3, false}}) {
    run_ranks([&](Engine& e) {
      const auto native = with_updater(e, c.schedule, OptimizerKind::kSgd, 8, false, nullptr,
                                       c.in_flight, c.identical);
      Model m(e.rank());
      const auto external = with_updater(e, c.schedule, OptimizerKind::kSgd, 8, false, nullptr,
                                         c.in_flight, c.identical, &m);
      EXPECT_EQ(external, native) << "in_flight " << c.in_flight;
      if (c.identical) EXPECT_EQ(external, reference(e, OptimizerKind::kSgd, 8, true));
    });
  }
}

TEST(Updater, RefusesAReducerItCannotServe) {
  run_ranks([&](Engine& e) {
    Model m(e.rank());
    auto reducer = e.make_reducer(m.specs(), reducer_options(2));
    UpdaterOptions options;  // priority
    try {
      Updater updater(e, *reducer, m.slots(), options);
      ADD_FAILURE() << "priority accepted a reducer with in_flight 2";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("priority needs ReducerOptions::in_flight = 1"),
                std::string::npos) << error.what();
    }
  });
}

TEST(Updater, PriorityRefusesAGradientOfAParameterReadBeforeItLanded) {
  run_ranks([&](Engine& e) {
    Model m(e.rank());
    auto reducer = e.make_reducer(m.specs(), reducer_options());
    UpdaterOptions options;
    options.rebuild_buckets = false;
    Updater updater(e, *reducer, m.slots(), options);
    updater.set_gates({{0, 1, 2}, {0}, {1}, {2}});
    m.backward(e.rank(), 0);
    for (size_t p = m.w.size(); p-- > 0;) reducer->mark(p, m.grad[p].data(), m.grad[p].data());
    StepOptions step;
    step.hyper = {sgd_hyper(0)};
    step.clip_max_norm = 1e9;  // needs the whole reduction: nothing lands in step()
    updater.step(static_cast<uint64_t>(reducer->finish_marking()), step);
    // The next forward reads parameter 2 without passing its gate (as a
    // model whose order of reads changed would): its gradient would be taken
    // at stale values.
    m.backward(e.rank(), 1);
    try {
      reducer->mark(2, m.grad[2].data(), m.grad[2].data());
      ADD_FAILURE() << "a gradient of a parameter that was not landed was accepted";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kAborted);
      EXPECT_NE(std::string(error.what()).find("'p2' was read in this forward before its update"),
                std::string::npos) << error.what();
    }
  });
}

TEST(Updater, DestroyedWhileGradientsAreMarkedAbortsThatIteration) {
  // The reducer would write the iteration's results into the updater's
  // buffers, so an updater that goes away mid-iteration takes the iteration
  // with it, and says so, rather than leaving the reducer to write into
  // freed memory or wait for gradients that never come.
  run_ranks([&](Engine& e) {
    Model m(e.rank());
    auto reducer = e.make_reducer(m.specs(), reducer_options());
    {
      UpdaterOptions options;
      options.schedule = UpdateSchedule::kDecoupled;
      Updater updater(e, *reducer, m.slots(), options);
      m.backward(e.rank(), 0);
      reducer->mark(2, m.grad[2].data(), m.grad[2].data());  // p0 and p1 never come
      EXPECT_TRUE(reducer->marking());
    }
    try {
      reducer->mark_ready(1, m.grad[1].data());
      ADD_FAILURE() << "the reducer went on after its updater was destroyed mid-iteration";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kAborted);
      EXPECT_NE(std::string(error.what()).find("its updater was destroyed"), std::string::npos)
          << error.what();
    }
  });
}

}  // namespace
}  // namespace hemiola
