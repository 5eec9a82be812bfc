// Task-level discrete-event simulation: every iteration of every job is a DAG
// of forward and backward tasks on each of its GPUs followed by one all-reduce
// (a barrier over all backwards) that contends for the network interfaces of
// the nodes the job spans.
#pragma once

#include <vector>

#include "interrupt.h"
#include "job.h"
#include "policy.h"
#include "result.h"

namespace hemiola::cluster {

SimulationResult simulate_tasks(const ClusterSpec& cluster, const std::vector<ModelSpec>& models,
                                const std::vector<JobSpec>& jobs, const PolicyConfig& policy,
                                const StopCheck& stop = {});

}  // namespace hemiola::cluster
