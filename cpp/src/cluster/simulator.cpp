#include "simulator.h"

#include <stdexcept>

namespace hemiola::cluster {

SimulationResult simulate(const ClusterSpec& cluster, const std::vector<ModelSpec>& models,
                          const std::vector<JobSpec>& jobs, const PolicyConfig& policy,
                          const StopCheck& stop) {
  validate_cluster(cluster);
  if (models.empty()) throw std::invalid_argument("simulate: no models");
  // Every metric of an empty workload would be a meaningless zero.
  if (jobs.empty()) throw std::invalid_argument("simulate: no jobs (the workload is empty)");
  if (jobs.size() > static_cast<size_t>(kMaxJobs)) {
    throw std::invalid_argument("simulate: more than " + std::to_string(kMaxJobs) + " jobs");
  }
  for (const auto& m : models) validate_model(m);
  for (const auto& j : jobs) validate_job(j, models, cluster);
  if (policy.kappa <= 0) throw std::invalid_argument("simulate: kappa must be > 0");
  if (policy.max_concurrent <= 0) throw std::invalid_argument("simulate: srsf:n needs n > 0");
  SimulationResult r = policy.fidelity == Fidelity::kTask
                           ? simulate_tasks(cluster, models, jobs, policy, stop)
                           : simulate_iterations(cluster, models, jobs, policy, stop);
  r.placement = placement_name(policy);
  r.comm = comm_name(policy);
  r.fidelity = fidelity_name(policy.fidelity);
  r.job_order = job_order_name(policy.job_order);
  return r;
}

}  // namespace hemiola::cluster
