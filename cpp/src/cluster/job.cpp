#include "job.h"

#include <cmath>
#include <stdexcept>

namespace hemiola::cluster {

void validate_job(const JobSpec& job, const std::vector<ModelSpec>& models,
                  const ClusterSpec& cluster) {
  const std::string who = job.origin.empty() ? "job " + std::to_string(job.id) : job.origin;
  if (job.model < 0 || job.model >= static_cast<int>(models.size())) {
    throw std::invalid_argument(who + ": unknown model index " + std::to_string(job.model));
  }
  if (job.num_gpus <= 0) {
    throw std::invalid_argument(who + ": num_gpus must be > 0, got " +
                                std::to_string(job.num_gpus));
  }
  if (job.num_gpus > cluster.total_gpus()) {
    throw std::invalid_argument(who + ": needs " + std::to_string(job.num_gpus) +
                                " GPUs but the cluster has only " +
                                std::to_string(cluster.total_gpus()));
  }
  if (job.iterations <= 0 || job.iterations > kMaxIterations) {
    throw std::invalid_argument(who + ": iterations must be in 1.." +
                                std::to_string(kMaxIterations) + ", got " +
                                std::to_string(job.iterations));
  }
  if (!(job.arrival_ms >= 0.0) || !std::isfinite(job.arrival_ms)) {
    throw std::invalid_argument(who + ": arrival_ms must be finite and >= 0");
  }
  const ModelSpec& m = models[job.model];
  if (m.memory_mb > cluster.gpu_memory_mb) {
    throw std::invalid_argument(who + ": model '" + m.name + "' needs " +
                                std::to_string(m.memory_mb) + " MB per GPU, more than a GPU has (" +
                                std::to_string(cluster.gpu_memory_mb) + " MB)");
  }
}

}  // namespace hemiola::cluster
