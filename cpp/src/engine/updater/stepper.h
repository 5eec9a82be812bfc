// The optimizer step that lands an update (hemiola/updater.h), behind one
// interface chosen once when the Updater is made: the engine's own SGD or
// Adam/AdamW (hemiola/optimizer.h), one parameter at a time, or the caller's
// ExternalStepper, one call per landing group (a call into Python costs far
// more than a parameter's step, so the landing graph hands over groups).
//
// Every step goes from a parameter's exact value (the parameter itself under
// priority, decoupled's shadow) into its live value. A committed step also
// advances the exact value and the optimizer state; a local chain
// (decoupled's approximate steps) advances neither. The landing graph hands
// over resolved groups (where each parameter, its exact value, its state and
// its gradient are): a stepper knows nothing of the graph.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "hemiola/update_types.h"

namespace hemiola {

// One step of several parameters with the gradients and hyper-parameters of
// one iteration.
struct StepGroup {
  std::vector<size_t> indices;      // parameters, ascending (an external stepper names them)
  std::vector<ParameterSlot*> params;  // per index: its live value and optimizer state
  std::vector<void*> exact;         // per index: its exact value (may be the live memory)
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
  // stepped; the optimizer state advances. On a GPU, enqueued on `stream`.
  virtual void commit(const StepGroup& group, StreamRef stream) = 0;
  // Local steps, nothing committed: live <- the exact value stepped with
  // chain[0], then chain[1], ... (every link holds the same parameters),
  // each step reading the state the previous one left in a scratch copy.
  virtual void local(const std::vector<StepGroup>& chain, StreamRef stream) = 0;
};

// The engine's SGD / Adam / AdamW (UpdaterOptions::optimizer), or the
// caller's stepper (UpdaterOptions::external), for parameters on `device`.
std::unique_ptr<Stepper> make_stepper(const Device& device, const UpdaterOptions& options);

}  // namespace hemiola
