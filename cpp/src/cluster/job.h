// A training job: which model, how many GPUs, how many iterations, when it arrives.
#pragma once

#include <string>
#include <vector>

#include "model.h"

namespace hemiola::cluster {

struct JobSpec {
  int id = 0;            // position in the workload; results are indexed by it
  int model = 0;         // index into the simulation's model list
  int num_gpus = 1;      // data-parallel workers, one per GPU
  long long iterations = 1;
  double arrival_ms = 0.0;
  std::string origin;    // where it came from (e.g. "philly.csv line 17"), for error messages
};

// Bounds on what a job may ask for. They are far above any real job (the
// longest job of the Philly trace is 53 days, 7.4e7 ResNet-50 iterations) and
// keep every count exact in a double and every simulated time finite.
constexpr long long kMaxIterations = 1'000'000'000;
constexpr int kMaxJobs = 10'000'000;

// Checks one job against the models and the cluster; errors name the job's origin.
void validate_job(const JobSpec& job, const std::vector<ModelSpec>& models,
                  const ClusterSpec& cluster);

}  // namespace hemiola::cluster
