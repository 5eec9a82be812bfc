// What a simulation returns, and the summary statistics computed from it.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "job.h"
#include "policy.h"

namespace hemiola::cluster {

struct JobResult {
  int id = 0;
  double arrival_ms = 0.0;
  double start_ms = 0.0;   // when it was placed
  double finish_ms = 0.0;
  double jct_ms = 0.0;     // finish - arrival
  double transferred_mb = 0.0;  // inter-node all-reduce volume actually moved
  long long iterations = 0;
  bool multi_node = false;      // its placement spans more than one node
  std::vector<int> gpus;
};

struct SimulationResult {
  std::vector<JobResult> jobs;  // indexed by job id
  double mean_jct_ms = 0.0;
  double median_jct_ms = 0.0;
  double p99_jct_ms = 0.0;      // nearest-rank 99th percentile
  double makespan_ms = 0.0;     // last finish time (the clock starts at 0)
  double gpu_utilization = 0.0; // busy GPU-time / (GPUs * makespan)
  // Utilisation over time as a step function: util_value[i] holds on
  // [util_time_ms[i], util_time_ms[i+1]).
  std::vector<double> util_time_ms;
  std::vector<double> util_value;
  long long events = 0;         // event-loop steps taken
  // Task level only: all-reduces started, and how many of them started next
  // to another transfer already running on one of their nodes (contention).
  long long transfers = 0;
  long long shared_transfer_starts = 0;
  std::string placement, comm, fidelity, job_order;
};

// Fills the JCT statistics and the makespan from `result.jobs`.
void summarize(SimulationResult& result);

// A job's total GPU-time if it ran alone: num_gpus x isolated time, counting an
// all-reduce when it needs more GPUs than one node has. The key of the "srsf"
// job order (smallest first) for jobs that have not started.
double job_gpu_time_ms(const JobSpec& job, const ModelSpec& model, const ClusterSpec& cluster);

// The result row of a finished job; `Job` is either simulator's job record.
template <typename Job>
JobResult job_result(const Job& j) {
  JobResult r;
  r.id = j.spec->id;
  r.arrival_ms = j.spec->arrival_ms;
  r.start_ms = j.start_ms;
  r.finish_ms = j.finish_ms;
  r.jct_ms = j.finish_ms - j.spec->arrival_ms;
  r.transferred_mb = j.transferred_mb;
  r.iterations = j.spec->iterations;
  r.multi_node = j.multi_node;
  r.gpus = j.gpus;
  return r;
}

// Puts waiting job ids in admission order: unchanged (arrival order) for
// kFifo; smallest total GPU-time first for kSrsf, ties keeping arrival order.
// `Job` is either simulator's job record (it has `spec` and `model` pointers).
template <typename Job>
void order_for_admission(std::vector<int>& pending, const std::vector<Job>& jobs, JobOrder order,
                         const ClusterSpec& cluster) {
  if (order != JobOrder::kSrsf) return;
  std::stable_sort(pending.begin(), pending.end(), [&](int a, int b) {
    return job_gpu_time_ms(*jobs[a].spec, *jobs[a].model, cluster) <
           job_gpu_time_ms(*jobs[b].spec, *jobs[b].model, cluster);
  });
}

// Lower bound on one job's completion time: its iterations run alone with no
// sharing and an uncontended all-reduce when `multi_node`.
double isolated_time_ms(const ModelSpec& model, long long iterations, bool multi_node,
                        const ClusterSpec& cluster);

}  // namespace hemiola::cluster
