#include "workload.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "rng.h"

namespace hemiola::cluster {

std::vector<JobSpec> paper_workload(const PaperWorkloadOptions& o, int num_models) {
  if (o.jobs < 0 || o.jobs > kMaxJobs) {
    throw std::invalid_argument("paper workload: jobs must be in 0.." + std::to_string(kMaxJobs) +
                                ", got " + std::to_string(o.jobs));
  }
  if (num_models <= 0) throw std::invalid_argument("paper workload: no models");
  if (o.min_iterations <= 0 || o.max_iterations < o.min_iterations ||
      o.max_iterations > kMaxIterations) {
    throw std::invalid_argument("paper workload: need 0 < min_iterations <= max_iterations <= " +
                                std::to_string(kMaxIterations));
  }
  if (!(o.arrival_window_ms >= 0.0) || !std::isfinite(o.arrival_window_ms)) {
    throw std::invalid_argument("paper workload: arrival_window_ms must be finite and >= 0");
  }
  // Cumulative distribution of GPUs per job, in units of 0.01% so it is exact.
  static const int kGpus[] = {1, 2, 4, 8, 16, 32};
  static const int kPermyriad[] = {5000, 875, 1625, 1875, 500, 125};
  Rng rng(o.seed);
  std::vector<JobSpec> jobs(o.jobs);
  for (int i = 0; i < o.jobs; ++i) {
    JobSpec& j = jobs[i];
    long long draw = rng.uniform_int(0, 9999);
    int k = 0;
    for (long long acc = kPermyriad[0]; draw >= acc; acc += kPermyriad[++k]) {
    }
    j.num_gpus = kGpus[k];
    j.model = static_cast<int>(rng.uniform_int(0, num_models - 1));
    j.iterations = rng.uniform_int(o.min_iterations, o.max_iterations);
    j.arrival_ms = rng.uniform() * o.arrival_window_ms;
  }
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const JobSpec& a, const JobSpec& b) { return a.arrival_ms < b.arrival_ms; });
  for (int i = 0; i < o.jobs; ++i) {
    jobs[i].id = i;
    jobs[i].origin = "paper workload job " + std::to_string(i);
  }
  return jobs;
}

}  // namespace hemiola::cluster
