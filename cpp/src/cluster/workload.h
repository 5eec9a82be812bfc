// The paper's synthetic workload (Wang et al. 2020), seeded.
#pragma once

#include <cstdint>
#include <vector>

#include "job.h"

namespace hemiola::cluster {

struct PaperWorkloadOptions {
  int jobs = 160;
  std::uint64_t seed = 0;
  long long min_iterations = 10;
  long long max_iterations = 60;
  double arrival_window_ms = 12000.0;
};

// GPUs per job: 1 (50%), 2 (8.75%), 4 (16.25%), 8 (18.75%), 16 (5%), 32 (1.25%);
// model uniform over `num_models`; iterations uniform in [min, max]; arrivals
// uniform in [0, window). Jobs are returned sorted by arrival, ids 0..n-1.
std::vector<JobSpec> paper_workload(const PaperWorkloadOptions& options, int num_models);

}  // namespace hemiola::cluster
