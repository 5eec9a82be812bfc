// The iteration ring: where gradients are marked into buckets, and whence
// "bucket b of iteration t is packed" is published to the lanes
// (engine/reducer/lane.h) that act on it.
//
// Each iteration k owns an InFlightIteration: its bucket storage, pending counts, slot
// states and outputs. Iteration k uses flight k % (in_flight + 1); before a
// flight is reused, every lane must be done with the iteration that used it
// last (that is the in-flight bound). A flight's per-iteration state is reset
// when it is taken, on the marking side, after its previous work completed,
// so no lane ever sees it change underneath.
//
// Concurrency: mark() runs on autograd threads (many at once, lock-free);
// begin (inside the first mark of an iteration), finish_marking, rebuild and
// abort on the user's thread; the lanes' work on their scheduler threads.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/buckets/bucket_plan.h"
#include "engine/buckets/bucket_storage.h"
#include "engine/reducer/mark_observer.h"
#include "hemiola/tensor.h"

namespace hemiola {

struct InFlightIteration;

// What the ring tells each of its lanes (engine/reducer/lane.h implements
// it), in the order they were added: the ring knows no more of a lane.
class RingListener {
 public:
  virtual ~RingListener() = default;
  // New in-flight iterations (no work in flight): per-iteration state for
  // `flights` of them.
  virtual void rebuild(size_t flights) = 0;
  // Under the ring's mutex: blocks until no work of this listener reads
  // `flight` any more, since iteration `next` is about to take it (rethrows
  // a failure of that work).
  virtual void release(const InFlightIteration& flight, uint64_t next) const = 0;
  // Under the ring's mutex, once `flight` was reset for a new iteration.
  virtual void begin(InFlightIteration& flight) = 0;
  // Producer threads: bucket `bucket` of `flight` is packed.
  virtual void packed(const InFlightIteration& flight, size_t bucket) = 0;
  // The ring was aborted: stop waiting for packed buckets.
  virtual void wake() = 0;
};

// What every part of a reducer reads: the gradients, their buckets and the
// issue order. Replaced only by a rebuild, with no iteration in flight.
struct ReducerPlan {
  std::vector<GradSpec> specs;                     // fixed for the reducer's life
  std::vector<PlannedBucket> buckets;
  std::vector<std::vector<Placement>> placement;   // per tensor, its pieces
  std::vector<size_t> issue_order;                 // a permutation of the buckets
  uint64_t first_iteration = 0;                    // the first iteration of this plan
};

constexpr uint64_t kNoIteration = ~uint64_t{0};

// One iteration in flight: its bucket memory and marking state, as the ring
// and its lanes share it. The ring holds in_flight + 1 of them, reused in
// turn by later iterations (hence `flight` for a variable of this type).
struct InFlightIteration {
  size_t slot = 0;                     // its index in the ring (lanes keep state per slot)
  uint64_t iteration = kNoIteration;   // the last iteration that took it
  std::unique_ptr<BucketStorage> storage;
  std::unique_ptr<std::atomic<int64_t>[]> pending;  // per bucket: pieces not yet marked
  std::unique_ptr<std::atomic<uint8_t>[]> state;    // per tensor (IterationRing::SlotState)
  std::vector<void*> out;                            // per tensor; null: keep only
  std::vector<float> usage;                          // per tensor, summed over ranks
};

class IterationRing {
 public:
  using MakeStorage = std::function<std::unique_ptr<BucketStorage>()>;

  // `plan` must outlive the ring. `in_flight`: how many earlier iterations
  // may still be in flight while one is marked. `record_order`: remember the
  // order in which the first iteration's gradients arrive.
  IterationRing(const ReducerPlan& plan, size_t in_flight, bool record_order);

  // Lanes are told of each iteration in the order they were added: a lane
  // that gates on another (Lane::gate_on) must be added after it.
  void add_lane(RingListener& lane);
  // New flights for the current plan (none may be in flight), each with
  // storage from `make_storage`; every lane rebuilds its state with them.
  void build(const MakeStorage& make_storage);
  // Replaces every flight's storage (before the first iteration only).
  void replace_storage(const MakeStorage& make_storage);

  // `observer` learns of every used gradient's mark from now on (see
  // mark_observer.h); forget() ends that. Only while nothing is marked.
  void observe(MarkObserver& observer);
  void forget(MarkObserver& observer);

  // Tensor `index`'s gradient, from `source` (zeros when !used), into its
  // buckets; its reduced value goes to `out` unless an observer says
  // otherwise (`local`: this rank's own gradient, for the observers). The
  // last piece of a bucket publishes it to every lane. The first mark of an
  // iteration takes its flight (and may wait for the in-flight bound).
  void mark(size_t index, const void* source, const void* local, void* out, bool used,
            void* stream);
  std::vector<size_t> unmarked() const;
  bool marking() const { return marking_.load(std::memory_order_acquire) != nullptr; }
  // Ends the marking of the current iteration; returns its number, or -1
  // when nothing was marked. Throws, naming them, if gradients are missing.
  int64_t finish_marking();
  uint64_t started() const { return started_.load(std::memory_order_acquire); }
  // The order in which the first recorded iteration's gradients arrived.
  std::vector<size_t> observed_order() const;
  void stop_recording() { recording_.store(false); }

  // Flights by iteration. The flight iteration `iteration` used; its
  // `iteration` field says whether a later one has reused it since.
  InFlightIteration& flight_for(uint64_t iteration) {
    return *flights_[iteration % flights_.size()];
  }
  const InFlightIteration& flight_for(uint64_t iteration) const {
    return *flights_[iteration % flights_.size()];
  }
  const InFlightIteration* marking_flight() const {
    return marking_.load(std::memory_order_acquire);
  }
  const std::vector<std::unique_ptr<InFlightIteration>>& flights() const { return flights_; }

  // Guards taking and releasing flights (begin, finish, rebuild) and every
  // lane's per-flight handle. May be held while waiting for an earlier
  // iteration's work, so lane work must never take it.
  std::mutex& mutex() const { return mutex_; }

  // Cancels: lanes stop waiting for buckets that will not become ready, and
  // every later call throws with `reason`.
  void abort(const std::string& reason);
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  std::string abort_reason() const;
  // Throws kAborted with the abort's reason, if aborted.
  void check_usable() const;
  // Names of the tensors `indices` (pieces of one tensor named once), at most `limit`.
  std::string names(const std::vector<size_t>& indices, size_t limit = 8) const;

 private:
  InFlightIteration& begin_iteration();

  const ReducerPlan& plan_;
  const size_t ring_size_;
  std::vector<RingListener*> lanes_;  // in the order they are told of an iteration
  std::vector<MarkObserver*> observers_;  // in the order they are told of a mark
  std::vector<std::unique_ptr<InFlightIteration>> flights_;

  std::atomic<InFlightIteration*> marking_{nullptr};  // the iteration being marked, if any
  std::atomic<uint64_t> started_{0};

  // Order recording (first iteration): each mark claims a position.
  std::atomic<bool> recording_;
  std::atomic<size_t> observed_count_{0};
  std::vector<size_t> observed_;

  mutable std::mutex mutex_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mutex_;  // guards abort_reason_
  std::string abort_reason_;
};

}  // namespace hemiola
