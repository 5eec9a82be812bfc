// The entry point: validate the inputs, then run the chosen fidelity.
#pragma once

#include <vector>

#include "interrupt.h"
#include "iteration_simulator.h"
#include "job.h"
#include "policy.h"
#include "result.h"
#include "task_simulator.h"

namespace hemiola::cluster {

// Throws std::invalid_argument (naming the job's origin) for inputs the
// simulators cannot run: no jobs, bad cluster, bad model, a job wider than the
// cluster or needing more memory than a GPU has, iterations out of 1..kMaxIterations, ...
// `stop` is polled every few milliseconds of the run (see interrupt.h); when it
// returns true the run ends with Interrupted.
SimulationResult simulate(const ClusterSpec& cluster, const std::vector<ModelSpec>& models,
                          const std::vector<JobSpec>& jobs, const PolicyConfig& policy,
                          const StopCheck& stop = {});

}  // namespace hemiola::cluster
