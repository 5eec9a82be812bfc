// The landing graph of hemiola/updater.h, shared by both schedules (their
// policies, update_policy.h, decide when to land what): the parameters, the
// pending iterations, which buckets each parameter waits for, the gates,
// what a forward read since the last step, and the exact step that lands an
// iteration on a parameter.
//
// The graph is small: at most in_flight iterations are pending (one for
// priority), oldest first, and per parameter each is either applied (landed)
// or waiting for its buckets; a parameter lands its iterations in order.
// Which buckets a parameter waits for comes from the reducer's plan; which
// parameters a gate needs comes from the caller. Everything here runs on
// the caller's thread; on a GPU every kernel, copy and wait is enqueued on the
// stream of the call in progress.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "cuda/device.h"
#include "engine/reducer/lane.h"
#include "engine/reducer/reduction_lane.h"
#include "engine/updater/device_clip.h"
#include "engine/updater/device_memory.h"
#include "engine/updater/stepper.h"
#include "hemiola/reducer.h"
#include "hemiola/engine.h"
#include "hemiola/status.h"
#include "hemiola/update_types.h"

namespace hemiola {

// An iteration whose update is not applied to every parameter yet.
struct Pending {
  uint64_t iteration = 0;
  StepOptions options;
  // Its results were written to the updater's own buffers and waited for
  // (the first iteration, whose buckets are rebuilt before it lands).
  bool gathered = false;
  std::vector<int> usage;      // how many ranks used each parameter (has_unused)
  bool scale_known = false;    // coef / skip below are computed
  double coef = 1.0;           // clip_grad_norm_'s coefficient
  const double* coef_device = nullptr;  // or, clipped on the device, where it is (DeviceClip)
  bool skip = false;           // some averaged gradient is not finite (GradScaler)
  std::vector<uint8_t> applied;    // per parameter
  std::vector<size_t> remaining;   // the parameters not applied yet, ascending
  std::vector<uint8_t> bucket_arrived;  // per bucket, once seen reduced
  // decoupled:
  std::vector<uint8_t> stepped;          // per parameter: took the local step
  std::vector<Buffer> local;             // in_flight > 1: the local gradients, to re-step
  // decoupled with a preview (ReducerOptions::preview):
  std::vector<uint8_t> previewed;        // per parameter: live = shadow stepped with the preview
  std::vector<uint8_t> bucket_previewed; // per bucket, once seen previewed

  // Some rank used parameter i (every one, without has_unused); `usage` is
  // read from the reducer when the iteration first lands.
  bool used(size_t i) const { return usage.empty() || usage[i] > 0; }
  bool needs_whole() const {
    return options.has_unused || options.clip_max_norm >= 0.0 || options.skip_if_not_finite;
  }
  // A preview can land: clipping scales it by StepOptions::preview_scale;
  // unused parameters and a GradScaler's skip are known only once the whole
  // iteration is reduced.
  bool preview_allowed() const { return !options.has_unused && !options.skip_if_not_finite; }
};

// The graph observes the reducer's marks (the Updater registers it): a
// gradient whose reduced value must outlive the reducer's buffers (a
// partitioned one, or the first iteration's) is sent to the graph's own, and
// on a GPU the mark's stream becomes the one the updater's work follows.
class LandingGraph : public MarkObserver {
 public:
  // No parameters yet: adopt() takes them.
  LandingGraph(Engine& engine, Reducer& reducer, const UpdaterOptions& options, StreamRef stream);

  // ---- parameters and gates ---------------------------------------------------

  // Takes `params` (checked to live on the reducer's device): every one is
  // its own exact value until set_exact(), and nothing was read or marked.
  void adopt(std::vector<ParameterSlot> params);
  // The results of iterations marked before the buckets are rebuilt go to
  // the updater's own buffers, so that they outlive the rebuild.
  void gather_until_rebuilt() { gather_until_rebuilt_ = true; }
  // Parameter i's exact value is at `exact` from now on (decoupled's shadow),
  // not the live parameter.
  void set_exact(size_t i, void* exact) { exact_[i] = exact; }
  // Updater::set_gates.
  void set_gates(std::vector<std::vector<size_t>> gates);
  // The parameters gate `l` reads first (throws for an unknown gate).
  const std::vector<size_t>& gate(size_t l) const;

  size_t size() const { return params_.size(); }
  const std::vector<ParameterSlot>& params() const { return params_; }
  const std::vector<size_t>& all() const { return all_; }
  void check_index(size_t index) const;
  // `options` has hyper-parameters for every group of the parameters.
  void check_hyper(const StepOptions& options) const;

  // ---- the reducer's plan ------------------------------------------------------

  // The reducer, for what concerns its plan (rebuilds, the issue order) and
  // its life; per bucket the graph reads the lanes' results instead.
  Reducer& reducer() { return reducer_; }
  // What the full reduction delivered: arrivals, waits, values, usage.
  ReductionLane& reduction() { return reduction_; }
  // decoupled's preview (null without ReducerOptions::preview).
  LaneResults* previews() { return previews_; }
  size_t in_flight() const { return in_flight_; }
  size_t bucket_count() const { return bucket_bytes_.size(); }
  const std::vector<double>& bucket_bytes() const { return bucket_bytes_; }
  const std::vector<size_t>& buckets_of(size_t i) const { return buckets_of_[i]; }
  bool partitioned(size_t i) const { return partitioned_[i] != 0; }
  bool rebuilt() const { return rebuilt_; }
  // Takes which buckets each parameter waits for from the reducer's plan.
  void refresh_buckets();
  // Every rank rebuilds the bucket plan in the observed gradient order (the
  // first iteration's: it must have landed, or been gathered).
  void rebuild_buckets();
  // MarkObserver: where the reducer writes the result (null: its own
  // buffers), and the stream of the call.
  void on_mark(Mark& mark) override;

  // ---- one iteration's marks and reads -----------------------------------------

  const void* local_grad(size_t i) const { return local_grads_[i]; }
  void set_local_grad(size_t i, const void* grad) { local_grads_[i] = grad; }
  void clear_local_grads();
  bool was_read(size_t i) const { return read_[i] != 0; }
  void clear_reads();
  void mark_read(const std::vector<size_t>& indices);

  // ---- pending iterations ------------------------------------------------------

  std::deque<Pending>& pending() { return pending_; }
  Pending& start_pending(uint64_t iteration, const StepOptions& options);
  // Parameter `index`'s buckets of `pending` are reduced (noted once seen).
  bool arrived(Pending& pending, size_t index) const;
  // Waits until `indices`' averaged gradients can be applied: their buckets
  // in issue order, or the whole iteration if the update needs it.
  void wait_for(const Pending& pending, const std::vector<size_t>& indices);
  // The parameters `chosen` (all arrived) take the exact step of `pending`.
  void apply(Pending& pending, const std::vector<size_t>& chosen);
  // The live parameter <- the exact one (nothing where they are the same).
  void restore(size_t i);
  std::optional<double> clip_norm(uint64_t iteration) const;
  // Updater::averaged: `iteration` was marked and not stepped yet.
  TensorRef averaged(uint64_t iteration, size_t index) const;

  // ---- optimizer steps -----------------------------------------------------------

  // The stepper's (engine/updater/stepper.h, chosen by the options) steps of
  // `group` / `chain` (indices, gradients and options given), on the stream:
  // the graph resolves where each parameter, its exact value and its state
  // are before it hands them over.
  void commit(StepGroup& group);
  void local(std::vector<StepGroup>& chain);

  // ---- device and stream -------------------------------------------------------

  const Device& device() const { return device_; }
  StreamRef stream() const { return stream_; }
  void use_stream(StreamRef stream);
  // On a GPU: before the reducer frees and reallocates its buffers (a
  // rebuild), the kernels enqueued on them must be done.
  void drain();
  // A copy on the parameters' device (on a GPU: enqueued on the stream).
  void copy(void* dst, const void* src, size_t bytes) const;

  // A timeline event on the compute lane; the name is only built when the
  // timeline is recorded (this is on the per-gate path).
  template <typename... Parts>
  void record(const char* category, int64_t start, const Parts&... name) {
    if (!timeline_) return;
    engine_.timeline_record("compute", detail::concat(name...), category, start,
                            engine_.timeline_now_us());
  }
  // The timeline's clock, for the start of an event.
  int64_t now_us() const { return engine_.timeline_now_us(); }

 private:
  const void* reduced(const Pending& pending, size_t index) const;
  // Whether the reduced value of `index` goes to the updater's own buffers
  // (on_mark) rather than staying in the reducer's.
  bool gathers(size_t index) const;
  std::vector<const void*> readable(const Pending& pending, const std::vector<size_t>& indices);
  void scale_of(Pending& pending);
  void clip_on_device(Pending& pending);
  void resolve(StepGroup& group);

  Engine& engine_;
  Reducer& reducer_;  // its plan: buckets, pieces, rebuilds
  ReductionLane& reduction_;  // per bucket: the graph is in buckets
  LaneResults* previews_;     // ReducerOptions::preview only
  UpdaterOptions options_;
  Device device_;      // the reducer's: every parameter, state and gradient lives there
  size_t in_flight_;   // the reducer's: at most this many iterations are pending
  StreamRef stream_;   // the stream of the call in progress (GPU: all work goes there)
  std::unique_ptr<cuda::Event> switched_;  // GPU: orders work across a change of stream
  bool timeline_;  // the engine records a timeline
  bool rebuilt_;
  bool gather_until_rebuilt_ = false;  // see gather_until_rebuilt()
  std::vector<ParameterSlot> params_;
  std::vector<void*> exact_;  // per parameter: its exact value (the live one, or a shadow)
  size_t groups_ = 0;  // 1 + the largest group index of params_
  std::vector<size_t> all_;
  std::vector<std::vector<size_t>> gates_;
  std::vector<std::vector<size_t>> buckets_of_;  // per parameter: its buckets (pieces)
  std::vector<double> bucket_bytes_;
  std::vector<uint8_t> partitioned_;  // per parameter: cut into pieces (result() cannot hold it)
  std::vector<const void*> local_grads_;  // this iteration's own gradients
  std::vector<uint8_t> read_;        // read by a forward since the last step()
  std::vector<std::vector<Buffer>> gathered_;  // per iteration % (in_flight + 1): results kept here
  std::vector<HostBuffer> staging_;  // GPU: host copies of averaged gradients (readable())
  std::deque<Pending> pending_;  // oldest first
  // (iteration, total norm) of the last clipped iterations, oldest first.
  std::deque<std::pair<uint64_t, double>> clip_norms_;
  // UpdaterOptions::device_clip_norms on a GPU with the engine's own steps.
  std::unique_ptr<DeviceClip> device_clip_;
  std::unique_ptr<Stepper> stepper_;
};

}  // namespace hemiola
