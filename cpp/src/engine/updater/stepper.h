// The optimizer step that lands an update (hemiola/updater.h), behind one
// interface chosen once when the Updater is made: the engine's own SGD or
// Adam/AdamW (hemiola/optimizer.h), one parameter at a time, or the caller's
// ExternalStepper, one call per landing group (a call into Python costs far
// more than a parameter's step, so the landing graph hands over groups).
//
// Every step goes from a parameter's exact value (LandingGraph::exact: the
// parameter itself under priority, decoupled's shadow) into its live value.
// A committed step also advances the exact value and the optimizer state; a
// local chain (decoupled's approximate steps) advances neither.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "hemiola/updater.h"

namespace hemiola {

class LandingGraph;

// One step of several parameters with the gradients and hyper-parameters of
// one iteration.
struct StepGroup {
  std::vector<size_t> indices;      // parameters, ascending
  std::vector<const void*> grads;   // per index: its gradient (the parameter's numel and dtype)
  const StepOptions* options = nullptr;  // the iteration's hyper-parameters
  double grad_scale = 1.0;          // clip_grad_norm_'s coefficient
  // Or that coefficient in device memory, computed on the GPU (DeviceClip;
  // the engine's own steppers only).
  const double* grad_scale_device = nullptr;
};

class Stepper {
 public:
  virtual ~Stepper() = default;
  // The exact step of `group`: live and exact value <- the exact value
  // stepped; the optimizer state advances.
  virtual void commit(const StepGroup& group) = 0;
  // Local steps, nothing committed: live <- the exact value stepped with
  // chain[0], then chain[1], ... (every link holds the same indices), each
  // step reading the state the previous one left in a scratch copy.
  virtual void local(const std::vector<StepGroup>& chain) = 0;
};

// The engine's SGD / Adam / AdamW (UpdaterOptions::optimizer), or the
// caller's stepper (UpdaterOptions::external). `graph` must outlive it.
std::unique_ptr<Stepper> make_stepper(LandingGraph& graph, const UpdaterOptions& options);

}  // namespace hemiola
