// The Updater's vocabulary (hemiola/updater.h): its schedules, the
// parameters it lands with their optimizer state, the options of an updater
// and of one step, and the external stepper a caller implements for any other
// optimizer. The engine's updater floor speaks these without the Updater
// class itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hemiola/export.h"
#include "hemiola/optimizer.h"
#include "hemiola/tensor.h"

namespace hemiola {

enum class UpdateSchedule : int { kPriority = 0, kDecoupled = 1 };

// A trainable parameter and its optimizer state (non-owning; the state has
// the parameter's dtype and size). Index i is the reducer's gradient i.
struct ParameterSlot {
  std::string name;                  // for error messages
  TensorRef param;                   // the live values forward reads (on the reducer's device)
  size_t group = 0;                  // its hyper-parameters: StepOptions::hyper[group]
  void* momentum_buffer = nullptr;   // SGD with momentum
  bool momentum_initialised = false; // false: the first step creates it (buf = grad)
  void* exp_avg = nullptr;           // Adam / AdamW
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;    // amsgrad
  float* step = nullptr;             // Adam: steps taken (torch's float32 "step")
};

// What an external step of a parameter starts from and what it leaves.
enum class StepMode : int {
  // The exact step: from the exact value and the optimizer state; the state
  // advances (the updater then takes the new live value as the exact one).
  kCommit = 0,
  // A local (approximate) step: from the exact value and a scratch copy of
  // the state; the state itself stays as it was.
  kLocal = 1,
  // Another local step after a kLocal (or kLocalAgain) one of the same
  // parameters in the same chain: from the live value and that scratch.
  kLocalAgain = 2,
};

// The optimizer step for optimizers the engine does not implement: the
// caller's (hemiola's Python layer runs torch's own optimizer step here).
// The updater calls it on the thread of the Updater call in progress (step,
// land, synchronize, step_local), once per landing group, never from an
// engine thread. Before a kCommit or kLocal call the updater has written
// each parameter's exact value into its live one (ParameterSlot::param); the
// step updates the live values in place, as torch's does. On a GPU the
// step's work goes on the stream of the call in progress (after the
// updater's waits there). What it throws propagates out of that call; the
// pending update it was landing is then lost (the live parameters may hold a
// part of it).
class ExternalStepper {
 public:
  virtual ~ExternalStepper() = default;
  // Parameters `indices` (the updater's order) take one step each with
  // gradient grads[k] (numel and dtype of the parameter, on its device;
  // valid during the call only) times `grad_scale` (clip_grad_norm_'s
  // coefficient; 1 otherwise), and the hyper-parameters of the caller's
  // step() that passed StepOptions::hyper_key == `hyper_key`.
  virtual void step(const std::vector<size_t>& indices, const std::vector<TensorRef>& grads,
                    uint64_t hyper_key, double grad_scale, StepMode mode) = 0;
};

struct UpdaterOptions {
  UpdateSchedule schedule = UpdateSchedule::kPriority;
  // The engine's own optimizer step (unless `external` is set).
  OptimizerKind optimizer = OptimizerKind::kSgd;
  // Non-null: every step is this one's (`optimizer`, the slots' state and
  // group, and StepOptions::hyper are not read); the updater keeps it.
  std::shared_ptr<ExternalStepper> external;
  // decoupled: land an exact step as soon as it has arrived (false: only in
  // step(), which makes training independent of network timing).
  bool correct_on_arrival = true;
  // priority: the share of gradient bytes, front layers first, whose buckets
  // are issued last (front-most first) after the rebuild.
  double priority_front_fraction = 0.25;
  // The first iteration is synchronous and the buckets are rebuilt in the
  // observed order (ReducerOptions::record_order must be on).
  bool rebuild_buckets = true;
  // Throw (ErrorCode::kNotFinite), naming it, when an averaged gradient
  // holds NaN or infinity; nothing of that iteration is applied.
  bool raise_if_not_finite = false;
  // The CPU Adam step's square root (hemiola/optimizer.h): torch's, to step
  // as torch does bit for bit.
  VectorSqrt sqrt;
  // The engine's own steps of a landing group go through sgd_steps /
  // adam_steps (hemiola/optimizer.h): on a GPU one kernel launch per up to 24
  // parameters instead of one each. Off: a step per parameter. Experimental
  // until it has run on a GPU (docs/gpu.md); the CPU result is the same.
  bool multi_tensor_steps = false;
  // A GPU with the engine's own steps: clipping's coefficient is computed on
  // the device and read there by the steps (engine/device_clip.h), so the
  // host never waits for a reduction to clip (without it, the averaged
  // gradients are copied to the host: one synchronisation per step). Not
  // with a GradScaler, whose skip the host decides. Experimental until it has
  // run on a GPU (docs/gpu.md).
  bool device_clip_norms = false;
  // Set: the total norm clipping scales by (StepOptions::clip_max_norm), of
  // the averaged gradients `grads` of parameters `indices` (those some rank
  // used; host memory, valid during the call) in `norm_type`, is this
  // function's: the caller's framework's own (torch's get_total_norm, summed
  // in its order), so that the coefficient is the one its clip_grad_norm_
  // computes bit for bit. Called on the thread of the Updater call that
  // lands, once per clipped iteration; CPU parameters only. Unset: the
  // engine's norm (each tensor's accumulated in double, then rounded).
  std::function<double(const std::vector<size_t>& indices, const std::vector<TensorRef>& grads,
                       double norm_type)>
      clip_norm;
};

// What one step() applies, as the iteration ran.
struct StepOptions {
  std::vector<OptimizerHyper> hyper;  // per parameter group (the engine's steppers)
  // UpdaterOptions::external: handed back to ExternalStepper::step with every
  // step taken for this call (the caller's key to its hyper-parameters).
  uint64_t hyper_key = 0;
  // Some parameters were contributed as zeros (Reducer::mark_unused, with
  // track_usage): a parameter no rank used is not stepped, as torch skips a
  // parameter without a gradient.
  bool has_unused = false;
  // torch.nn.utils.clip_grad_norm_ of the averaged gradient (max_norm < 0:
  // none): every gradient is scaled by min(1, max_norm / (norm + 1e-6)).
  double clip_max_norm = -1.0;
  double clip_norm_type = 2.0;
  // A GradScaler is in use: if any averaged gradient is not finite (some rank
  // overflowed) the iteration's update is skipped on every rank.
  bool skip_if_not_finite = false;
  // decoupled: this rank's own gradient overflowed; no approximate step.
  bool local_overflow = false;
  // decoupled with a preview and clipping: the factor the preview step scales
  // the estimated average by, the clipping coefficient of this rank's own
  // gradient (the averaged gradient's needs the whole of it; the exact step
  // applies that one).
  double preview_scale = 1.0;
};

}  // namespace hemiola
