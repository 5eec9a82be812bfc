// The per-iteration path of the schedules that apply updates after backward
// returns (`priority`, `decoupled`): which parameter waits for which reduced
// gradient, where in the next forward it must be brought up to date, and the
// optimizer step that does it (hemiola/optimizer.h).
//
// One Updater drives one Reducer. Per iteration its caller makes:
//   Reducer::mark(i, ...) for every gradient as backward produces it (the
//     updater observes the marks and decides where the result goes),
//   Reducer::finish_marking() at the end of backward (it numbers iterations),
//   step(iteration, ...) where torch's optimizer.step() would be,
//   land(l) at the start of each "gate" of the next forward: a point in the
//     forward (a module's forward pre-hook) before which parameters
//     gates[l] are first read. Gates are learnt by the caller (hemiola's
//     Python layer observes the first forward) and handed over as integers;
//     gate 0 is always "every parameter" (the very start of the forward).
//
// Schedules:
//   kPriority: exact synchronous SGD. step() applies the update of every
//     parameter whose reduction has arrived; land(l) waits for gates[l]'s
//     buckets and applies theirs. A parameter is written only if no forward
//     read it since step() (autograd may still need the value), or when a
//     gate needs it.
//   kDecoupled: step() lands the previous iteration's exact step (waiting if
//     needed) and takes the approximate step: the exact parameters (the
//     shadow, kept by the updater) stepped with this rank's own gradient,
//     written to the live parameters only. The exact step lands, from the
//     shadow with the averaged gradient, as soon as it has arrived and no
//     forward still reads the approximate value (correct_on_arrival), at the
//     latest in the next step(). With a reducer that takes a preview
//     (ReducerOptions::preview), a parameter is instead stepped again from
//     the shadow with the preview's estimate of the average once its preview
//     arrives (land() waits for it), and the exact steps land only in
//     step(): every forward reads estimates, none a mix of exact back layers
//     and approximate front ones (measured worse). The reducer's in_flight
//     bounds the pending iterations: step() of iteration t lands t - in_flight
//     (waiting) before taking t's approximate step; each parameter lands its
//     iterations in order. Invariant per parameter: live = shadow stepped
//     with the local gradient of every pending iteration that has not landed
//     it, in order (with a preview, in_flight 1: its estimate instead). After
//     an older iteration lands, the later local steps are taken again, from
//     copies of their gradients and through scratch optimizer state.
//
// Both take their first iteration synchronously when rebuild_buckets is set:
// its reduction is waited for, then every rank rebuilds the bucket plan in the
// observed gradient order (priority also issues the front layers' buckets
// last, front-most first, so the next forward's first modules get theirs
// first).
//
// The optimizer step that lands an update is a stepper's: the engine's own
// SGD or Adam/AdamW (hemiola/optimizer.h), or an ExternalStepper (below) that
// the caller implements for any other per-parameter optimizer (hemiola's
// Python layer runs torch's own step there). Either way the landing graph is
// this one. The optimizer state lives in caller memory (ParameterSlot, or the
// external stepper's own), in torch's layout, so a torch optimizer's
// state_dict() stays valid. Parameters, state
// and gradients live on the reducer's device (ReducerOptions::device). On a
// GPU every call takes the caller's compute stream (StreamRef, as the
// Reducer's calls do): the optimizer steps (the fused kernels of
// hemiola/optimizer.h, one launch per parameter) and the updater's copies are
// enqueued there, and a wait for a reduction is a wait of that stream on the
// device, never of the host (except clipping, a GradScaler and
// raise_if_not_finite, which copy averaged gradients to the host and wait for
// them wherever they read them: a synchronisation per step, and with
// raise_if_not_finite per landing). Calls may come on different streams: a
// call on a new stream first makes it wait for what the updater enqueued on
// the previous one. Not thread-safe: one thread calls it, as one training
// loop does.
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

class Engine;
class Reducer;

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

class UpdaterImpl;

class HEMIOLA_API Updater {
 public:
  // `engine` and `reducer` must outlive the updater; `params` follow the
  // reducer's gradient order, on its device. The decoupled shadow is copied
  // from the live parameters now (on a GPU: enqueued on `stream`).
  Updater(Engine& engine, Reducer& reducer, std::vector<ParameterSlot> params,
          const UpdaterOptions& options, StreamRef stream = {});
  // Blocks until the reductions still in flight are done (on a GPU, on the
  // device too): they write into the updater's buffers. An iteration still
  // being marked can never complete without the updater: it is aborted, and
  // the reducer with it (make a new one to go on).
  ~Updater();
  Updater(const Updater&) = delete;
  Updater& operator=(const Updater&) = delete;

  // gates[0] must be every parameter; the others may overlap nothing.
  // Call between iterations (e.g. once the first forward is learnt).
  void set_gates(std::vector<std::vector<size_t>> gates);

  // The hook path is the reducer's: Reducer::mark(index, source, local,
  // stream), whose observers the updater is. `local` is this rank's gradient
  // as the optimizer would see it (decoupled's approximate step reads it in
  // step(); it must stay valid and may be edited in place until then, e.g.
  // clipped). priority refuses the mark (throws, and aborts the reducer) if
  // `index` still waits for the previous update (it was read before it was
  // updated: the gradient would be wrong).
  //
  // The local gradient of a parameter contributed as zeros (null: none).
  void set_local_grad(size_t index, void* local_grad);

  // optimizer.step() after a backward whose marking closed as `iteration`.
  void step(uint64_t iteration, const StepOptions& options, StreamRef stream = {});
  // optimizer.step() with no reduced backward since the last one: lands
  // everything, then one exact step with these local gradients (null: skip).
  void step_local(const std::vector<void*>& grads, const StepOptions& options,
                  StreamRef stream = {});

  // The forward reaches gate `gate`: brings its parameters up to date
  // (waiting for their reductions), and lands whatever else has arrived and
  // was not read yet. `training`: the forward will be backpropagated (counts
  // reads for approximate_read_fraction()).
  void land(size_t gate, bool training, StreamRef stream = {});

  // Lands everything pending (waits; on a GPU `stream` waits): the live
  // parameters are exact for work enqueued on `stream` from now on.
  void synchronize(StreamRef stream = {});
  // The parameters or optimizer state were overwritten (a checkpoint was
  // loaded): what was pending is dropped; the shadow is taken from `params`.
  void replace_parameters(std::vector<ParameterSlot> params, StreamRef stream = {});

  // The device the parameters live on (the reducer's).
  Device device() const;

  // Per parameter: the SGD momentum buffer holds a value (a first step was
  // committed), as torch would have created it.
  std::vector<bool> momentum_initialised() const;
  // decoupled: share of parameter elements training forwards read while they
  // still held the approximation.
  double approximate_read_fraction() const;
  // decoupled with a preview: share of parameter elements training forwards
  // read while they held the preview's approximation (part of the above).
  double preview_read_fraction() const;
  // The total norm clip_grad_norm_ found for `iteration`'s averaged gradient
  // (StepOptions::clip_max_norm >= 0), once a landing of that iteration has
  // computed it; nullopt before (or for the oldest iterations: the last 16
  // are kept).
  std::optional<double> clip_norm(uint64_t iteration) const;
  // The averaged gradient of parameter `index` in `iteration`, once the
  // reducer has waited for it and before step(iteration): in the reducer's
  // buffers, or, for a tensor partitioned over several buckets (which
  // Reducer::result cannot return), in the buffer its pieces were reduced
  // into. Valid until that step lands it.
  TensorRef averaged(uint64_t iteration, size_t index) const;

 private:
  std::unique_ptr<UpdaterImpl> impl_;
};

}  // namespace hemiola
