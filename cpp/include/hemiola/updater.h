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
#include "hemiola/update_types.h"

namespace hemiola {

class Engine;
class Reducer;

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
