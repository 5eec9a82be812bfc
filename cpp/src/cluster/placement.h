// Placement policies: which GPUs a newly admitted job gets.
#pragma once

#include <vector>

#include "model.h"
#include "policy.h"
#include "rng.h"

namespace hemiola::cluster {

// A GPU can host a job while its free memory covers the job's model memory;
// several jobs may share a GPU (they then take turns computing).
struct PlacementRequest {
  int num_gpus = 1;
  double memory_mb = 0.0;
};

// Returns the chosen GPU ids (ascending), or an empty vector when fewer than
// num_gpus GPUs have enough free memory right now.
//  - first-fit: the lowest-numbered GPUs with enough memory;
//  - random: uniformly among the GPUs with enough memory (uses `rng`);
//  - lwf:K: `load_ms[g]` is GPU g's workload (remaining compute + communication
//    time of its jobs). Jobs of <= K GPUs take the least-loaded GPUs anywhere;
//    larger jobs are packed: nodes in order of total workload, and on each node
//    its least-loaded eligible GPUs, until the job is placed.
// Ties are broken by GPU / node id, so placement is deterministic.
std::vector<int> place_job(const PolicyConfig& policy, const ClusterSpec& cluster,
                           const std::vector<double>& free_memory_mb,
                           const std::vector<double>& load_ms, const PlacementRequest& request,
                           Rng& rng);

}  // namespace hemiola::cluster
