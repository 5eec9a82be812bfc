// Iteration-level (fluid) simulation for trace-scale runs. Each running job
// advances through its iterations at a constant rate between events; the rate
// is set by its placement (how many jobs share its GPUs) and by the current
// contention at the busiest node it spans. Rates are recomputed only at
// events (arrivals and completions); nothing is ticked.
#pragma once

#include <vector>

#include "interrupt.h"
#include "job.h"
#include "policy.h"
#include "result.h"

namespace hemiola::cluster {

// Per-iteration all-reduce time of a job of `size_mb` whose busiest node
// carries `jobs_on_node` multi-node jobs under a policy that lets at most
// `cap` transfers run at once on a node (documented in docs/cluster.md):
// with m <= cap all m run together at 1/(m*beta + (m-1)*eta) each; with m > cap
// the node runs cap at a time and each job gets a 1/m share of that throughput.
double fluid_comm_ms(double size_mb, int jobs_on_node, int cap, const ClusterSpec& cluster);

SimulationResult simulate_iterations(const ClusterSpec& cluster,
                                     const std::vector<ModelSpec>& models,
                                     const std::vector<JobSpec>& jobs, const PolicyConfig& policy,
                                     const StopCheck& stop = {});

}  // namespace hemiola::cluster
