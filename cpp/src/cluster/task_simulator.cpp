#include "task_simulator.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "contention.h"
#include "placement.h"
#include "rng.h"

namespace hemiola::cluster {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Job {
  const JobSpec* spec = nullptr;
  const ModelSpec* model = nullptr;
  std::vector<int> gpus;
  std::vector<int> nodes;  // distinct nodes of `gpus`, ascending
  bool multi_node = false;
  long long iterations_done = 0;
  // Per worker (index into gpus): 0 = forward pending, 1 = backward pending, 2 = done.
  std::vector<int> worker_stage;
  int backwards_left = 0;
  // The all-reduce of the current iteration is waiting to start; once
  // started it lives in the Network until it completes.
  bool comm_waiting = false;
  double transferred_mb = 0.0;
  double start_ms = 0.0;
  double finish_ms = 0.0;
};

struct Gpu {
  double free_memory_mb = 0.0;
  std::vector<int> resident;  // jobs placed here
  // Ready compute tasks: (job, worker index). A job has at most one ready or
  // running task per GPU because its worker's backward follows its forward.
  std::vector<std::pair<int, int>> ready;
  int running_job = -1;
  int running_worker = -1;
  double busy_until = 0.0;
};

class TaskSimulator {
 public:
  TaskSimulator(const ClusterSpec& cluster, const std::vector<ModelSpec>& models,
                const std::vector<JobSpec>& specs, const PolicyConfig& policy)
      : cluster_(cluster), policy_(policy), rng_(policy.seed), network_(cluster) {
    jobs_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      jobs_[i].spec = &specs[i];
      jobs_[i].model = &models[specs[i].model];
    }
    gpus_.resize(cluster.total_gpus());
    for (auto& g : gpus_) g.free_memory_mb = cluster.gpu_memory_mb;
    arrival_order_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) arrival_order_[i] = static_cast<int>(i);
    std::stable_sort(arrival_order_.begin(), arrival_order_.end(), [&](int a, int b) {
      return specs[a].arrival_ms < specs[b].arrival_ms;
    });
  }

  SimulationResult run(const StopCheck& stop);

 private:
  // Remaining isolated time of a job: compute of the iterations not yet
  // finished plus the not-yet-transferred all-reduce volume at the
  // uncontended rate. Used as the GPU workload by LWF.
  double remaining_time_ms(int id) const {
    const Job& j = jobs_[id];
    const long long left = j.spec->iterations - j.iterations_done;
    double comm_mb = 0.0;
    if (j.multi_node) {
      comm_mb = static_cast<double>(left) * j.model->size_mb;
      if (network_.is_active(id)) comm_mb -= j.model->size_mb - network_.remaining_mb(id);
    }
    return static_cast<double>(left) * j.model->compute_ms() + comm_mb * cluster_.beta_ms_per_mb;
  }
  // SRSF priority: remaining GPU-time = GPUs x remaining isolated time.
  double remaining_gpu_time(int id) const {
    return jobs_[id].spec->num_gpus * remaining_time_ms(id);
  }
  bool before(int a, int b) const {
    const double pa = remaining_gpu_time(a), pb = remaining_gpu_time(b);
    return pa != pb ? pa < pb : a < b;
  }

  void admit_and_place(double now);
  void start_iteration(int id);
  void start_transfers();
  bool may_start_transfer(const Job& j) const;
  void start_compute(double now);
  void finish_compute(int gpu, double now);
  void finish_iteration(int id, double now);

  const ClusterSpec& cluster_;
  const PolicyConfig& policy_;
  Rng rng_;
  std::vector<Job> jobs_;
  std::vector<Gpu> gpus_;
  Network network_;  // all-reduces in flight, keyed by job id
  std::vector<int> arrival_order_;
  size_t next_arrival_ = 0;
  std::vector<int> pending_;       // arrived, not yet placed (arrival or srsf order)
  std::vector<int> comm_waiting_;  // jobs whose all-reduce is ready but not started
  bool placement_dirty_ = false;   // something arrived or finished since the last try
  int done_ = 0;
  long long transfers_ = 0;
  long long shared_starts_ = 0;
};

void TaskSimulator::admit_and_place(double now) {
  while (next_arrival_ < arrival_order_.size() &&
         jobs_[arrival_order_[next_arrival_]].spec->arrival_ms <= now) {
    const int id = arrival_order_[next_arrival_++];
    pending_.push_back(id);
    placement_dirty_ = true;
  }
  if (!placement_dirty_ || pending_.empty()) return;
  placement_dirty_ = false;
  std::vector<double> free(gpus_.size()), load(gpus_.size(), 0.0);
  auto refresh = [&]() {
    for (size_t g = 0; g < gpus_.size(); ++g) {
      free[g] = gpus_[g].free_memory_mb;
      if (policy_.placement == PlacementKind::kLeastWorkloadFirst) {
        double w = 0.0;
        for (int id : gpus_[g].resident) w += remaining_time_ms(id);
        load[g] = w;
      }
    }
  };
  refresh();
  // First come (or smallest first), first served with backfilling: a job that
  // does not fit now does not block later jobs that do.
  order_for_admission(pending_, jobs_, policy_.job_order, cluster_);
  std::vector<int> still_pending;
  for (int id : pending_) {
    Job& j = jobs_[id];
    const auto chosen = place_job(policy_, cluster_, free, load,
                                  {j.spec->num_gpus, j.model->memory_mb}, rng_);
    if (chosen.empty()) {
      still_pending.push_back(id);
      continue;
    }
    j.gpus = chosen;
    for (int g : chosen) {
      gpus_[g].free_memory_mb -= j.model->memory_mb;
      gpus_[g].resident.push_back(id);
      const int node = cluster_.node_of(g);
      if (j.nodes.empty() || j.nodes.back() != node) j.nodes.push_back(node);
    }
    j.multi_node = j.nodes.size() > 1;
    j.start_ms = now;
    start_iteration(id);
    refresh();
  }
  pending_.swap(still_pending);
}

void TaskSimulator::start_iteration(int id) {
  Job& j = jobs_[id];
  j.worker_stage.assign(j.gpus.size(), 0);
  j.backwards_left = static_cast<int>(j.gpus.size());
  for (size_t w = 0; w < j.gpus.size(); ++w) {
    gpus_[j.gpus[w]].ready.emplace_back(id, static_cast<int>(w));
  }
}

bool TaskSimulator::may_start_transfer(const Job& j) const {
  for (int node : j.nodes) {
    const auto& active = network_.on_node(node);
    if (policy_.comm == CommKind::kSrsf) {
      if (static_cast<int>(active.size()) >= policy_.max_concurrent) return false;
    } else {  // AdaDUAL: idle node, or exactly one running transfer that is long enough
      if (active.size() >= 2) return false;
      if (active.size() == 1 &&
          !adadual_may_share(network_.remaining_mb(active[0]), j.model->size_mb, cluster_)) {
        return false;
      }
    }
  }
  return true;
}

void TaskSimulator::start_transfers() {
  if (comm_waiting_.empty()) return;
  std::sort(comm_waiting_.begin(), comm_waiting_.end(),
            [&](int a, int b) { return before(a, b); });
  std::vector<int> still_waiting;
  for (int id : comm_waiting_) {
    Job& j = jobs_[id];
    if (!may_start_transfer(j)) {
      still_waiting.push_back(id);
      continue;
    }
    j.comm_waiting = false;
    ++transfers_;
    for (int node : j.nodes) {
      if (!network_.on_node(node).empty()) {
        ++shared_starts_;
        break;
      }
    }
    network_.start(id, j.nodes, j.model->size_mb);
  }
  comm_waiting_.swap(still_waiting);
}

void TaskSimulator::start_compute(double now) {
  for (auto& gpu : gpus_) {
    if (gpu.running_job >= 0 || gpu.ready.empty()) continue;
    size_t best = 0;
    for (size_t i = 1; i < gpu.ready.size(); ++i) {
      if (before(gpu.ready[i].first, gpu.ready[best].first)) best = i;
    }
    const auto [id, worker] = gpu.ready[best];
    gpu.ready.erase(gpu.ready.begin() + static_cast<long>(best));
    const Job& j = jobs_[id];
    const bool backward = j.worker_stage[worker] == 1;
    gpu.running_job = id;
    gpu.running_worker = worker;
    gpu.busy_until = now + (backward ? j.model->backward_ms : j.model->forward_ms);
  }
}

void TaskSimulator::finish_compute(int g, double now) {
  Gpu& gpu = gpus_[g];
  const int id = gpu.running_job, worker = gpu.running_worker;
  gpu.running_job = gpu.running_worker = -1;
  Job& j = jobs_[id];
  if (j.worker_stage[worker] == 0) {
    j.worker_stage[worker] = 1;
    gpu.ready.emplace_back(id, worker);  // this worker's backward
    return;
  }
  j.worker_stage[worker] = 2;
  if (--j.backwards_left > 0) return;
  // Barrier reached: every backward of this iteration is done.
  if (j.multi_node) {
    j.comm_waiting = true;
    comm_waiting_.push_back(id);
  } else {
    finish_iteration(id, now);  // all-reduce inside one node is free
  }
}

void TaskSimulator::finish_iteration(int id, double now) {
  Job& j = jobs_[id];
  if (++j.iterations_done < j.spec->iterations) {
    start_iteration(id);
    return;
  }
  j.finish_ms = now;
  for (int g : j.gpus) {
    gpus_[g].free_memory_mb += j.model->memory_mb;
    auto& r = gpus_[g].resident;
    r.erase(std::find(r.begin(), r.end(), id));
  }
  ++done_;
  placement_dirty_ = true;
}

SimulationResult TaskSimulator::run(const StopCheck& stop) {
  StopPoller poller(stop);
  SimulationResult result;
  double now = 0.0;
  double busy_area = 0.0;  // GPU-ms spent computing
  const int total = static_cast<int>(jobs_.size());
  long long events = 0;
  const double n_gpus = static_cast<double>(gpus_.size());
  while (done_ < total) {
    poller.poll(events, now);
    ++events;
    // Decisions at `now`: admit and place, start transfers and compute tasks.
    admit_and_place(now);
    start_transfers();
    start_compute(now);

    int busy = 0;
    double next = kInf;
    if (next_arrival_ < arrival_order_.size()) {
      next = jobs_[arrival_order_[next_arrival_]].spec->arrival_ms;
    }
    for (const auto& gpu : gpus_) {
      if (gpu.running_job >= 0) {
        ++busy;
        next = std::min(next, gpu.busy_until);
      }
    }
    next = std::min(next, network_.next_finish_ms());
    const double util = busy / n_gpus;
    if (result.util_value.empty() || result.util_value.back() != util) {
      result.util_time_ms.push_back(now);
      result.util_value.push_back(util);
    }
    if (next == kInf) {
      throw std::logic_error("task simulator: no event pending but " +
                             std::to_string(total - done_) + " jobs unfinished");
    }
    // Advance time. Transfer progress changes only here (see Network).
    busy_area += busy * (next - now);
    const auto finished_transfers = network_.advance_to(next);
    now = next;

    for (size_t g = 0; g < gpus_.size(); ++g) {
      if (gpus_[g].running_job >= 0 && gpus_[g].busy_until <= now) {
        finish_compute(static_cast<int>(g), now);
      }
    }
    for (const auto& t : finished_transfers) {
      jobs_[t.id].transferred_mb += t.moved_mb;
      finish_iteration(t.id, now);
    }
  }
  result.util_time_ms.push_back(now);
  result.util_value.push_back(0.0);

  result.jobs.clear();
  for (const Job& j : jobs_) result.jobs.push_back(job_result(j));
  summarize(result);
  result.gpu_utilization =
      result.makespan_ms > 0.0 ? busy_area / (n_gpus * result.makespan_ms) : 0.0;
  result.events = events;
  result.transfers = transfers_;
  result.shared_transfer_starts = shared_starts_;
  return result;
}

}  // namespace

SimulationResult simulate_tasks(const ClusterSpec& cluster, const std::vector<ModelSpec>& models,
                                const std::vector<JobSpec>& jobs, const PolicyConfig& policy,
                                const StopCheck& stop) {
  TaskSimulator sim(cluster, models, jobs, policy);
  return sim.run(stop);
}

}  // namespace hemiola::cluster
