#include "iteration_simulator.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "contention.h"
#include "placement.h"
#include "rng.h"

namespace hemiola::cluster {

double fluid_comm_ms(double size_mb, int m, int cap, const ClusterSpec& c) {
  if (m <= 1) return size_mb / transfer_rate(1, c);
  if (m <= cap) return size_mb / transfer_rate(m, c);
  const double node_throughput = cap * transfer_rate(cap, c);  // MB/ms summed over transfers
  return size_mb * m / node_throughput;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Job {
  const JobSpec* spec = nullptr;
  const ModelSpec* model = nullptr;
  std::vector<int> gpus;
  std::vector<int> nodes;
  bool multi_node = false;
  double progress = 0.0;       // iterations completed (fractional)
  double iteration_ms = 0.0;   // current time per iteration, set at each event
  double transferred_mb = 0.0;
  double start_ms = 0.0;
  double finish_ms = 0.0;
};

class IterationSimulator {
 public:
  IterationSimulator(const ClusterSpec& cluster, const std::vector<ModelSpec>& models,
                     const std::vector<JobSpec>& specs, const PolicyConfig& policy)
      : cluster_(cluster), policy_(policy), rng_(policy.seed) {
    jobs_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      jobs_[i].spec = &specs[i];
      jobs_[i].model = &models[specs[i].model];
    }
    free_mb_.assign(cluster.total_gpus(), cluster.gpu_memory_mb);
    resident_.resize(cluster.total_gpus());
    arrival_order_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) arrival_order_[i] = static_cast<int>(i);
    std::stable_sort(arrival_order_.begin(), arrival_order_.end(), [&](int a, int b) {
      return specs[a].arrival_ms < specs[b].arrival_ms;
    });
  }

  SimulationResult run(const StopCheck& stop);

 private:
  double remaining_time_ms(const Job& j) const {
    const double left = static_cast<double>(j.spec->iterations) - j.progress;
    const double comm = j.multi_node ? j.model->size_mb * cluster_.beta_ms_per_mb : 0.0;
    return left * (j.model->compute_ms() + comm);
  }
  void place_pending(double now);
  void update_rates();
  int node_cap(int node) const;

  const ClusterSpec& cluster_;
  const PolicyConfig& policy_;
  Rng rng_;
  std::vector<Job> jobs_;
  std::vector<double> free_mb_;
  std::vector<std::vector<int>> resident_;  // jobs per GPU
  std::vector<int> arrival_order_;
  size_t next_arrival_ = 0;
  std::vector<int> pending_;
  std::vector<int> running_;
  // Scratch, rebuilt at every event.
  std::vector<std::vector<int>> node_jobs_;  // multi-node running jobs per node
};

void IterationSimulator::place_pending(double now) {
  if (pending_.empty()) return;
  const bool lwf = policy_.placement == PlacementKind::kLeastWorkloadFirst;
  std::vector<double> load(free_mb_.size(), 0.0);
  auto refresh_load = [&]() {
    if (!lwf) return;
    for (size_t g = 0; g < resident_.size(); ++g) {
      double w = 0.0;
      for (int id : resident_[g]) w += remaining_time_ms(jobs_[id]);
      load[g] = w;
    }
  };
  refresh_load();
  order_for_admission(pending_, jobs_, policy_.job_order, cluster_);
  std::vector<int> still_pending;
  for (int id : pending_) {
    Job& j = jobs_[id];
    const auto chosen = place_job(policy_, cluster_, free_mb_, load,
                                  {j.spec->num_gpus, j.model->memory_mb}, rng_);
    if (chosen.empty()) {
      still_pending.push_back(id);
      continue;
    }
    j.gpus = chosen;
    for (int g : chosen) {
      free_mb_[g] -= j.model->memory_mb;
      resident_[g].push_back(id);
      const int node = cluster_.node_of(g);
      if (j.nodes.empty() || j.nodes.back() != node) j.nodes.push_back(node);
    }
    j.multi_node = j.nodes.size() > 1;
    j.start_ms = now;
    running_.push_back(id);
    refresh_load();
  }
  pending_.swap(still_pending);
}

int IterationSimulator::node_cap(int node) const {
  if (policy_.comm == CommKind::kSrsf) return policy_.max_concurrent;
  // AdaDUAL never lets equal-sized transfers share; two may share only when
  // the longer is at least threshold x the shorter. At fluid granularity we
  // allow pairs on a node when its largest and smallest model pass that test.
  double lo = kInf, hi = 0.0;
  for (int id : node_jobs_[node]) {
    lo = std::min(lo, jobs_[id].model->size_mb);
    hi = std::max(hi, jobs_[id].model->size_mb);
  }
  return adadual_may_share(hi, lo, cluster_) ? 2 : 1;
}

void IterationSimulator::update_rates() {
  node_jobs_.assign(cluster_.nodes, {});
  for (int id : running_) {
    if (!jobs_[id].multi_node) continue;
    for (int node : jobs_[id].nodes) node_jobs_[node].push_back(id);
  }
  std::vector<int> caps(cluster_.nodes, 1);
  for (int n = 0; n < cluster_.nodes; ++n) {
    if (node_jobs_[n].size() > 1) caps[n] = node_cap(n);
  }
  for (int id : running_) {
    Job& j = jobs_[id];
    // GPUs are time-shared equally among resident jobs: the most crowded GPU
    // of the job sets its compute pace (workers synchronise every iteration).
    size_t share = 1;
    for (int g : j.gpus) share = std::max(share, resident_[g].size());
    double comm_ms = 0.0;
    if (j.multi_node) {
      for (int n : j.nodes) {
        comm_ms = std::max(comm_ms, fluid_comm_ms(j.model->size_mb,
                                                  static_cast<int>(node_jobs_[n].size()), caps[n],
                                                  cluster_));
      }
    }
    j.iteration_ms = static_cast<double>(share) * j.model->compute_ms() + comm_ms;
  }
}

SimulationResult IterationSimulator::run(const StopCheck& stop) {
  StopPoller poller(stop);
  SimulationResult result;
  const int total = static_cast<int>(jobs_.size());
  const double n_gpus = static_cast<double>(free_mb_.size());
  double now = 0.0, busy_area = 0.0;
  int done = 0;
  long long events = 0;
  while (done < total) {
    poller.poll(events, now);
    ++events;
    bool changed = false;
    while (next_arrival_ < arrival_order_.size() &&
           jobs_[arrival_order_[next_arrival_]].spec->arrival_ms <= now) {
      pending_.push_back(arrival_order_[next_arrival_++]);
      changed = true;
    }
    if (changed) place_pending(now);
    update_rates();

    double next = next_arrival_ < arrival_order_.size()
                      ? jobs_[arrival_order_[next_arrival_]].spec->arrival_ms
                      : kInf;
    double busy_gpus = 0.0;  // sum over GPUs of the fraction of time spent computing
    for (int id : running_) {
      const Job& j = jobs_[id];
      next = std::min(next, now + (j.spec->iterations - j.progress) * j.iteration_ms);
      busy_gpus += j.spec->num_gpus * j.model->compute_ms() / j.iteration_ms;
    }
    const double util = busy_gpus / n_gpus;
    if (result.util_value.empty() || result.util_value.back() != util) {
      result.util_time_ms.push_back(now);
      result.util_value.push_back(util);
    }
    if (next == kInf) {
      throw std::logic_error("iteration simulator: no event pending but " +
                             std::to_string(total - done) + " jobs unfinished");
    }
    const double dt = next - now;
    busy_area += busy_gpus * dt;
    std::vector<int> still_running;
    bool freed = false;
    for (int id : running_) {
      Job& j = jobs_[id];
      const double finish = now + (j.spec->iterations - j.progress) * j.iteration_ms;
      const double left = static_cast<double>(j.spec->iterations) - j.progress;
      const double advanced = finish <= next ? left : std::min(left, dt / j.iteration_ms);
      j.progress += advanced;
      if (j.multi_node) j.transferred_mb += advanced * j.model->size_mb;
      if (finish > next) {
        still_running.push_back(id);
        continue;
      }
      j.progress = static_cast<double>(j.spec->iterations);
      j.finish_ms = next;
      for (int g : j.gpus) {
        free_mb_[g] += j.model->memory_mb;
        auto& r = resident_[g];
        r.erase(std::find(r.begin(), r.end(), id));
      }
      ++done;
      freed = true;
    }
    running_.swap(still_running);
    now = next;
    if (freed) place_pending(now);
  }
  result.util_time_ms.push_back(now);
  result.util_value.push_back(0.0);

  result.jobs.clear();
  for (const Job& j : jobs_) result.jobs.push_back(job_result(j));
  summarize(result);
  result.gpu_utilization =
      result.makespan_ms > 0.0 ? busy_area / (n_gpus * result.makespan_ms) : 0.0;
  result.events = events;
  return result;
}

}  // namespace

SimulationResult simulate_iterations(const ClusterSpec& cluster,
                                     const std::vector<ModelSpec>& models,
                                     const std::vector<JobSpec>& jobs, const PolicyConfig& policy,
                                     const StopCheck& stop) {
  IterationSimulator sim(cluster, models, jobs, policy);
  return sim.run(stop);
}

}  // namespace hemiola::cluster
