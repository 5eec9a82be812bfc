// Gradient reducer: fuses gradients into buckets and all-reduces each bucket
// as soon as all its gradients are ready, while backward is still running.
//
// Life of iteration k:
//   mark_ready(i, ...) for each gradient as autograd produces it (any thread,
//   lock-free: copies the gradient into its bucket and decrements the bucket's
//   atomic pending count; the last one enqueues the bucket), mark_unused(i)
//   for gradients that will not come, finish_marking() at the end of backward,
//   then wait(k) whenever the result is needed. The engine's scheduler issues
//   buckets strictly in plan order 0, 1, 2, ... on every rank, whatever order
//   they become ready in, and writes the (averaged) results to the outputs
//   given to mark_ready and keeps them readable through result(k, i).
//
// On a CUDA reducer (ReducerOptions::device) the same calls take the CUDA
// stream involved (StreamRef; ignored on CPU). mark_ready enqueues the copy of the gradient into
// its bucket on the stream the gradient was produced on, and records an
// event the engine's communication stream waits on; the waits
// return once the reductions are enqueued and make the given stream wait for
// them on the device. The host never blocks on the user's stream, and the
// user's stream never waits for more than the result it asked for.
//
// Up to `ReducerOptions::in_flight` earlier iterations may still be reducing
// while a new one marks gradients: each in-flight iteration has buffers of its
// own. Iteration k's results stay readable until iteration k + in_flight + 1
// starts marking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hemiola/config.h"
#include "hemiola/export.h"
#include "hemiola/handle.h"
#include "hemiola/tensor.h"

namespace hemiola {

class ReducerImpl;
class LaneResults;   // engine-internal (engine/reducer/lane.h)
class ReductionLane;  // engine-internal (engine/reducer/reduction_lane.h)
class MarkObserver;  // engine-internal (engine/reducer/mark_observer.h)

// A bucket of the fusion plan when no tensor is partitioned: whole tensors,
// in pack order, tensor tensors[k] at element offsets[k].
struct FusedBucket {
  DType dtype = DType::kFloat32;
  std::vector<size_t> tensors;
  std::vector<size_t> offsets;
  size_t numel = 0;
};

// The reducer's fusion rule (torch DDP's) as a pure function: gradients
// expected ready in `order`, one open bucket per dtype, the first bucket
// closing at first_bucket_bytes and the rest at fusion_bytes, buckets in plan
// order. Every rank computes the same plan from the same inputs; a reducer
// made with these caps and no partition_bytes plans the same buckets (the
// `sharded` schedule, which buckets without a reducer, relies on it).
HEMIOLA_API std::vector<FusedBucket> plan_fusion(const std::vector<GradSpec>& specs,
                                                 const std::vector<size_t>& order,
                                                 size_t first_bucket_bytes, size_t fusion_bytes);

class HEMIOLA_API Reducer {
 public:
  explicit Reducer(std::unique_ptr<ReducerImpl> impl);
  ~Reducer();

  // Hook path. Copies gradient `index` into its bucket; the reduced value is
  // written back to the same memory. `grad` must match spec `index` and stay
  // alive until the iteration's wait() returns. Throws if `index` was already
  // marked in this iteration.
  void mark_ready(size_t index, const TensorRef& grad, StreamRef stream = {});
  // Same, taking only the data pointer (dtype and count from the spec).
  void mark_ready(size_t index, void* data, StreamRef stream = {});
  // Source and destination apart: `out` receives the reduced value, or, when
  // null, it is only kept in the reducer (see result()). `source` may be
  // reused as soon as this returns (on CUDA: by work enqueued on `stream`
  // after this call).
  void mark_ready(size_t index, const void* source, void* out, StreamRef stream = {});
  // For a reducer whose results an Updater lands (hemiola/updater.h): copies
  // `source` in and tells the mark observers (the updater's), which decide
  // where the result goes; `local` is this rank's own gradient (it differs
  // from `source` when the contribution is unscaled for a GradScaler), which
  // the updater reads until its step(). Otherwise as mark_ready.
  void mark(size_t index, const void* source, const void* local, StreamRef stream = {});
  // Contributes zeros for `index` this iteration; nothing is written back.
  void mark_unused(size_t index, StreamRef stream = {});
  // `observer` learns of every used gradient's mark from now on, on the
  // marking thread (engine/reducer/mark_observer.h); forget_marks ends that.
  // Only while nothing is being marked.
  void observe_marks(MarkObserver& observer);
  void forget_marks(MarkObserver& observer);
  // Indices not yet marked in the iteration being marked (all, if none is).
  std::vector<size_t> unmarked() const;
  // True while an iteration is being marked (something was marked and
  // finish_marking() was not called yet).
  bool marking() const;
  // Ends the marking of the current iteration and returns its number, or -1
  // when nothing was marked. Throws, naming them, if gradients are missing.
  int64_t finish_marking();

  // Blocks until iteration `iteration` is reduced and written back. Throws on
  // failure or after the engine's timeout, naming the pending buckets.
  void wait(uint64_t iteration, StreamRef stream = {});
  // Blocks until the gradients `indices` of `iteration` are reduced (their
  // buckets, in issue order; the others may still be in flight): the first
  // layers of the next forward need not wait for the last. Throws like wait().
  void wait_for(uint64_t iteration, const std::vector<size_t>& indices, StreamRef stream = {});
  // Those of `indices` whose result in `iteration` is reduced (on CUDA:
  // complete on the device). Never blocks.
  std::vector<size_t> arrived(uint64_t iteration, const std::vector<size_t>& indices) const;
  // finish_marking(), then waits for every iteration submitted so far.
  void wait(StreamRef stream = {});
  // Cancels the current iteration: the scheduler stops waiting for buckets
  // that will not become ready. The reducer is unusable afterwards.
  void abort(const std::string& reason);

  // Once it is reduced (wait(), wait_for() or arrived()): the reduced value of
  // `index` inside the reducer's buffers (valid until iteration + in_flight + 1
  // starts marking). Not for a partitioned tensor (its pieces live in several
  // buckets): give mark_ready an output instead.
  TensorRef result(uint64_t iteration, size_t index) const;
  // How far this rank's previews were from the averages they estimate, over
  // every previewed bucket so far: sqrt(sum |estimate - average|^2 /
  // sum |average|^2) (0 before the first).
  double preview_error() const;
  // ReducerOptions::compression kInt8, kInt4 or kPowerSgd: what this rank's coding
  // of gradient `index` has dropped so far and will add to its next gradient
  // (float32, one per element; empty for a gradient that is never compressed). Waits for
  // every iteration submitted so far; valid for the reducer's life. Read it
  // for a checkpoint and write it back on a resume, between iterations.
  TensorRef residual(size_t index);
  // Changes ReducerOptions::compression (and PowerSGD's rank and first
  // compressed iteration); only before the first iteration (every rank must
  // do the same: the coding decides what travels).
  void set_compression(Compression compression, size_t powersgd_rank = 2,
                       uint64_t powersgd_start_iteration = 10);
  // After wait(iteration) with track_usage: how many ranks produced a
  // gradient for each tensor.
  std::vector<int> usage(uint64_t iteration) const;

  // The current plan: bucket b holds (pieces of) tensors buckets()[b], in pack
  // order; a partitioned tensor appears in several buckets.
  std::vector<std::vector<size_t>> buckets() const;
  // How many pieces tensor `index` is cut into by the current plan (1: it is
  // whole, and result() can return it).
  size_t pieces(size_t index) const;
  // Order in which tensors became ready in the first recorded iteration.
  std::vector<size_t> observed_order() const;
  // Collective: every rank adopts rank 0's observed order and rebuilds its
  // plan from it. Call between iterations, on every rank.
  void rebuild_from_observed_order();
  // Local: rebuild the plan so tensors are bucketed in `order`.
  void rebuild(const std::vector<size_t>& order);
  // The order in which buckets are issued: a permutation of the plan's
  // buckets (default: plan order). Must be the same on every rank. Reset to
  // plan order by a rebuild. Call between iterations.
  void set_issue_order(const std::vector<size_t>& order);
  std::vector<size_t> issue_order() const;

  // The options it was made with.
  const ReducerOptions& options() const;

  // Iterations started so far (the next iteration's number).
  uint64_t iterations_started() const;

  // Waits until no work of this reducer writes to the outputs given to
  // mark_ready any more, successfully or not (never throws), on the host and
  // on the device. With `abort_marking`, an iteration still being marked is
  // aborted first (its buckets would never all become ready), and the
  // reducer with it. Device work that does not end within the engine's
  // timeout is cut off by aborting the device communicator.
  void drain(bool abort_marking) noexcept;

  // The engine's own view, per bucket, of what each lane delivered (the
  // Updater and tests read it; buckets are an internal unit, and
  // LaneResults is declared in the engine's sources): the full reduction,
  // and decoupled's preview (null without ReducerOptions::preview).
  ReductionLane& reduction_results();
  LaneResults* preview_results();

 private:
  std::unique_ptr<ReducerImpl> impl_;
};

}  // namespace hemiola
