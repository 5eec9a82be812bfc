// End-to-end checks of both simulators against hand-computed timelines, plus
// conservation and determinism on the paper's workload.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "cluster/contention.h"
#include "cluster/simulator.h"
#include "cluster/workload.h"

namespace hemiola::cluster {
namespace {

ModelSpec tiny(double size_mb, double memory_mb = 1000.0) {
  return {"tiny", size_mb, 1.0, 1.0, memory_mb};
}

JobSpec job(int id, int gpus, long long iters, double arrival) {
  JobSpec j;
  j.id = id;
  j.model = 0;
  j.num_gpus = gpus;
  j.iterations = iters;
  j.arrival_ms = arrival;
  return j;
}

PolicyConfig policy(const std::string& placement, const std::string& comm,
                    Fidelity f = Fidelity::kTask) {
  PolicyConfig p;
  parse_placement(placement, p);
  parse_comm(comm, p);
  p.fidelity = f;
  return p;
}

TEST(TaskSimulator, SingleGpuJobIsPureCompute) {
  ClusterSpec c;
  auto r = simulate(c, builtin_models(), {job(0, 1, 10, 0.0)}, policy("lwf:4", "srsf:1"));
  EXPECT_DOUBLE_EQ(r.jobs[0].jct_ms, 10 * (36.0 + 54.0));  // VGG-16, no communication
  EXPECT_EQ(r.jobs[0].transferred_mb, 0.0);
  EXPECT_FALSE(r.jobs[0].multi_node);
}

TEST(TaskSimulator, EightGpuVggSpansTwoNodes) {
  ClusterSpec c;  // 4 GPUs per node: lwf:4 packs an 8-GPU job onto two nodes
  auto r = simulate(c, builtin_models(), {job(0, 8, 2, 0.0)}, policy("lwf:4", "srsf:1"));
  EXPECT_TRUE(r.jobs[0].multi_node);
  EXPECT_NEAR(r.jobs[0].jct_ms, 2 * (90.0 + 526.4 * 0.856), 1e-9);
  EXPECT_NEAR(r.jobs[0].transferred_mb, 2 * 526.4, 1e-9);
}

// Two 1-iteration jobs on the same two GPUs (one per node), both arriving at 0.
// Compute serialises: A fwd [0,1], A bwd [1,2], B fwd [2,3], B bwd [3,4].
// A's all-reduce starts at 2 alone; B's is ready at 4.

TEST(TaskSimulator, TwoJobsUnderEachCommPolicy) {
  ClusterSpec c;
  c.nodes = 2;
  c.gpus_per_node = 1;
  const std::vector<ModelSpec> models{tiny(100.0)};
  const std::vector<JobSpec> jobs{job(0, 2, 1, 0.0), job(1, 2, 1, 0.0)};
  const double b = 0.856, e = 0.235;
  // SRSF(1) and Ada-SRSF (R = 97.66 < 2.549 * 100, so no sharing): B waits.
  for (const char* comm : {"srsf:1", "ada-srsf"}) {
    auto r = simulate(c, models, jobs, policy("first-fit", comm));
    EXPECT_NEAR(r.jobs[0].jct_ms, 2.0 + 100 * b, 1e-9) << comm;
    EXPECT_NEAR(r.jobs[1].jct_ms, 2.0 + 200 * b, 1e-9) << comm;
  }
  // SRSF(2): B joins at 4; A has 100 - 2/b MB left, both at 1/(2b+e) until A
  // ends; then B's last (2/b) MB run alone and take exactly 2 ms.
  auto r = simulate(c, models, jobs, policy("first-fit", "srsf:2"));
  const double a_end = 4.0 + (100.0 - 2.0 / b) * (2 * b + e);
  EXPECT_NEAR(r.jobs[0].jct_ms, a_end, 1e-9);
  EXPECT_NEAR(r.jobs[1].jct_ms, a_end + 2.0, 1e-9);
}

// AdaDUAL at its boundary inside the simulator. Three nodes with one GPU each,
// lwf:2. Job A (2 GPUs, GPUs 0-1) arrives at 0, computes [0,2] and starts its
// all-reduce at 2. Job B (2 GPUs, 100 MB) arrives at 3 and takes GPU 2 (idle)
// and GPU 0; its all-reduce is ready at 5 and shares node 0 with A, whose
// remaining size is then R = size_A - 3/beta. B may start at once iff R/100 >= threshold.
double job_b_jct(double ratio) {
  ClusterSpec c;
  c.nodes = 3;
  c.gpus_per_node = 1;
  const double b = c.beta_ms_per_mb;
  const double size_a = ratio * 100.0 + 3.0 / b;
  const std::vector<ModelSpec> models{{"a", size_a, 1.0, 1.0, 1000.0}, tiny(100.0)};
  JobSpec a = job(0, 2, 1, 0.0);
  JobSpec bj = job(1, 2, 1, 3.0);
  bj.model = 1;
  auto r = simulate(c, models, {a, bj}, policy("lwf:2", "ada-srsf"));
  EXPECT_EQ(r.jobs[0].gpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(r.jobs[1].gpus, (std::vector<int>{0, 2}));
  return r.jobs[1].jct_ms;
}

TEST(TaskSimulator, AdaDualBoundaryInSimulation) {
  ClusterSpec c;
  const double thr = adadual_threshold(c);
  const double b = c.beta_ms_per_mb, e = c.eta_ms_per_mb;
  // Just above: B starts at 5 next to A and ends 100 MB later at the 2-way rate
  // (A is longer, so k = 2 for all of B's transfer).
  EXPECT_NEAR(job_b_jct(thr * (1 + 1e-6)), 5.0 + 100 * (2 * b + e) - 3.0, 1e-6);
  // Just below: B waits for A (R * beta), then runs alone.
  const double r_below = thr * (1 - 1e-6) * 100.0;
  EXPECT_NEAR(job_b_jct(thr * (1 - 1e-6)), 5.0 + r_below * b + 100 * b - 3.0, 1e-6);
}

void check_conservation(const SimulationResult& r, const std::vector<JobSpec>& jobs,
                        const std::vector<ModelSpec>& models, const ClusterSpec& c) {
  ASSERT_EQ(r.jobs.size(), jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const ModelSpec& m = models[jobs[i].model];
    const JobResult& j = r.jobs[i];
    const double expect = j.multi_node ? m.size_mb * static_cast<double>(jobs[i].iterations) : 0.0;
    EXPECT_NEAR(j.transferred_mb, expect, 1e-6 * std::max(1.0, expect)) << "job " << i;
    // No job finishes before it could have alone.
    EXPECT_GE(j.jct_ms + 1e-6, isolated_time_ms(m, jobs[i].iterations, j.multi_node, c))
        << "job " << i;
    EXPECT_GE(j.start_ms, jobs[i].arrival_ms);
  }
  EXPECT_GT(r.gpu_utilization, 0.0);
  EXPECT_LE(r.gpu_utilization, 1.0 + 1e-12);
}

TEST(Simulators, ConservationOnPaperWorkload) {
  ClusterSpec c;
  const auto models = builtin_models();
  PaperWorkloadOptions o;
  o.seed = 3;
  const auto jobs = paper_workload(o, static_cast<int>(models.size()));
  for (const char* placement : {"first-fit", "random", "lwf:1", "lwf:4"}) {
    for (const char* comm : {"srsf:1", "srsf:2", "ada-srsf"}) {
      for (Fidelity f : {Fidelity::kTask, Fidelity::kIteration}) {
        SCOPED_TRACE(std::string(placement) + " " + comm + " " + fidelity_name(f));
        auto r = simulate(c, models, jobs, policy(placement, comm, f));
        check_conservation(r, jobs, models, c);
      }
    }
  }
}

TEST(Simulators, DeterministicForASeed) {
  ClusterSpec c;
  const auto models = builtin_models();
  PaperWorkloadOptions o;
  o.seed = 11;
  const auto a = paper_workload(o, 4), b = paper_workload(o, 4);
  o.seed = 12;
  const auto other = paper_workload(o, 4);
  auto p = policy("random", "ada-srsf");
  p.seed = 5;
  const auto ra = simulate(c, models, a, p), rb = simulate(c, models, b, p);
  for (size_t i = 0; i < ra.jobs.size(); ++i) EXPECT_EQ(ra.jobs[i].jct_ms, rb.jobs[i].jct_ms);
  EXPECT_EQ(ra.makespan_ms, rb.makespan_ms);
  EXPECT_NE(simulate(c, models, other, p).mean_jct_ms, ra.mean_jct_ms);
}

TEST(PaperWorkload, Distribution) {
  PaperWorkloadOptions o;
  o.jobs = 20000;
  o.seed = 1;
  const auto jobs = paper_workload(o, 4);
  std::map<int, int> gpus;
  for (const auto& j : jobs) {
    ++gpus[j.num_gpus];
    EXPECT_GE(j.iterations, 10);
    EXPECT_LE(j.iterations, 60);
    EXPECT_GE(j.arrival_ms, 0.0);
    EXPECT_LT(j.arrival_ms, 12000.0);
  }
  EXPECT_NEAR(gpus[1] / 20000.0, 0.50, 0.015);
  EXPECT_NEAR(gpus[8] / 20000.0, 0.1875, 0.015);
  EXPECT_NEAR(gpus[32] / 20000.0, 0.0125, 0.005);
  for (size_t i = 1; i < jobs.size(); ++i) EXPECT_LE(jobs[i - 1].arrival_ms, jobs[i].arrival_ms);
}

TEST(IterationSimulator, FluidCommLaw) {
  ClusterSpec c;
  const double b = 0.856, e = 0.235;
  EXPECT_NEAR(fluid_comm_ms(100, 1, 1, c), 100 * b, 1e-9);
  EXPECT_NEAR(fluid_comm_ms(100, 2, 1, c), 200 * b, 1e-9);          // take turns
  EXPECT_NEAR(fluid_comm_ms(100, 2, 2, c), 100 * (2 * b + e), 1e-9);  // 194.7
  EXPECT_NEAR(fluid_comm_ms(100, 3, 2, c), 100 * 3 * (2 * b + e) / 2, 1e-9);
}

TEST(IterationSimulator, AloneMatchesIsolatedTime) {
  ClusterSpec c;
  const auto models = builtin_models();
  auto r = simulate(c, models, {job(0, 8, 40, 5.0)},
                    policy("lwf:4", "srsf:1", Fidelity::kIteration));
  EXPECT_NEAR(r.jobs[0].jct_ms, 40 * (90.0 + 526.4 * 0.856), 1e-6);
  EXPECT_NEAR(r.makespan_ms, 5.0 + 40 * (90.0 + 526.4 * 0.856), 1e-6);
}

// Two 1-GPU jobs sharing one GPU (first-fit) take turns: each iteration
// costs 2 x compute for both, so both end at 2 x 10 x 90 ms.
TEST(IterationSimulator, SharedGpuHalvesSpeed) {
  ClusterSpec c;
  auto r = simulate(c, builtin_models(), {job(0, 1, 10, 0.0), job(1, 1, 10, 0.0)},
                    policy("first-fit", "srsf:1", Fidelity::kIteration));
  EXPECT_EQ(r.jobs[0].gpus, r.jobs[1].gpus);
  EXPECT_NEAR(r.jobs[0].jct_ms, 1800.0, 1e-9);
  EXPECT_NEAR(r.jobs[1].jct_ms, 1800.0, 1e-9);
  // The task level agrees in total work: the two jobs finish by 1800 ms.
  auto t = simulate(c, builtin_models(), {job(0, 1, 10, 0.0), job(1, 1, 10, 0.0)},
                    policy("first-fit", "srsf:1"));
  EXPECT_NEAR(t.makespan_ms, 1800.0, 1e-9);
}

}  // namespace
}  // namespace hemiola::cluster

namespace hemiola::cluster {
namespace {

// Two multi-node jobs on disjoint nodes do not contend at either fidelity.
TEST(Simulators, DisjointJobsRunAsIfAlone) {
  ClusterSpec c;
  c.nodes = 4;
  c.gpus_per_node = 1;
  const std::vector<ModelSpec> models{{"m", 200.0, 10.0, 20.0, 20000.0}};  // one job per GPU
  const std::vector<JobSpec> jobs{job(0, 2, 5, 0.0), job(1, 2, 5, 0.0)};
  for (Fidelity f : {Fidelity::kTask, Fidelity::kIteration}) {
    auto r = simulate(c, models, jobs, policy("first-fit", "srsf:1", f));
    EXPECT_EQ(r.jobs[1].gpus, (std::vector<int>{2, 3}));
    for (const auto& j : r.jobs) EXPECT_NEAR(j.jct_ms, 5 * (30.0 + 200.0 * 0.856), 1e-9);
  }
}

}  // namespace
}  // namespace hemiola::cluster
