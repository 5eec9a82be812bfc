#include "result.h"

#include <algorithm>
#include <cmath>

namespace hemiola::cluster {

void summarize(SimulationResult& r) {
  std::vector<double> jct;
  jct.reserve(r.jobs.size());
  double makespan = 0.0;
  for (const auto& j : r.jobs) {
    jct.push_back(j.jct_ms);
    makespan = std::max(makespan, j.finish_ms);
  }
  r.makespan_ms = makespan;
  if (jct.empty()) {
    r.mean_jct_ms = r.median_jct_ms = r.p99_jct_ms = 0.0;
    return;
  }
  std::sort(jct.begin(), jct.end());
  double sum = 0.0;
  for (double v : jct) sum += v;
  const size_t n = jct.size();
  r.mean_jct_ms = sum / static_cast<double>(n);
  r.median_jct_ms = n % 2 ? jct[n / 2] : 0.5 * (jct[n / 2 - 1] + jct[n / 2]);
  const auto rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(n)));
  r.p99_jct_ms = jct[std::max<size_t>(rank, 1) - 1];
}

double isolated_time_ms(const ModelSpec& m, long long iterations, bool multi_node,
                        const ClusterSpec& c) {
  const double per_iter = m.compute_ms() + (multi_node ? m.size_mb * c.beta_ms_per_mb : 0.0);
  return static_cast<double>(iterations) * per_iter;
}

double job_gpu_time_ms(const JobSpec& job, const ModelSpec& model, const ClusterSpec& cluster) {
  return job.num_gpus *
         isolated_time_ms(model, job.iterations, job.num_gpus > cluster.gpus_per_node, cluster);
}

}  // namespace hemiola::cluster
