// A lane: a wire of the engine (a communicator and a scheduler thread), and
// an ordered per-bucket step over each iteration's packed buckets.
//
// The iteration ring (iteration_ring.h) tells every lane when an iteration
// begins and when each of its buckets is packed. A lane that takes the
// iteration submits one unit of work to its wire; that work walks the
// buckets in issue order (the same on every rank, whatever order they were
// packed in on this one), waits for each to be packed, runs the lane's step
// on it and then marks the bucket done. Waiters (the Reducer's waits, the
// Updater) read what a lane delivered through LaneResults.
//
// Lanes compose without knowing each other's kind: a lane may gate on
// another (wait for all of that lane's buckets of the same iteration before
// its first step) and may be observed (a function runs on its thread after
// each step, before the bucket counts as done).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/ready_queue.h"
#include "core/timeline.h"
#include "engine/reducer/iteration_ring.h"
#include "engine/wire/scheduler.h"
#include "hemiola/handle.h"
#include "hemiola/tensor.h"

namespace hemiola {

// What a lane has delivered, per bucket of an iteration.
class LaneResults {
 public:
  virtual ~LaneResults() = default;
  // Whether bucket `bucket` of `iteration` has this lane's result (on CUDA:
  // complete on the device). False for an iteration the lane skips or that
  // has not started; true for one whose flight a later iteration reused.
  // Never blocks.
  virtual bool done(uint64_t iteration, size_t bucket) const = 0;
  // Blocks until done() (returns at once for an iteration the lane skips);
  // throws as the lane's work failed. On CUDA, `stream` waits on the device.
  virtual void wait(uint64_t iteration, size_t bucket, void* stream) = 0;
  // Blocks until the buckets holding tensors `indices` are done, in issue
  // order (the whole tensor: every bucket it has a piece in).
  virtual void wait_for(uint64_t iteration, const std::vector<size_t>& indices,
                        void* stream) = 0;
  // Blocks until the lane's whole work on `iteration` is done, after its
  // last bucket too (returns at once for an iteration it skips or whose
  // flight was reused); throws as that work failed. On CUDA, `stream` waits
  // on the device for all of it. Not while `iteration` is being marked.
  virtual void wait_iteration(uint64_t iteration, void* stream) = 0;
  // Once done(): the lane's value of tensor `index` in `iteration`, inside
  // the lane's buffers (valid until iteration + in_flight + 1 starts
  // marking). Not for a tensor partitioned across buckets.
  virtual TensorRef value(uint64_t iteration, size_t index) const = 0;
};

class Lane : public LaneResults, public RingListener {
 public:
  using Observer = std::function<void(InFlightIteration&, size_t bucket)>;

  // `timeline_lane`: the timeline row its events go on; `what`: what its
  // work is, for messages ("gradient reduction").
  Lane(std::string timeline_lane, std::string what, const IterationRing& ring,
       const ReducerPlan& plan, Scheduler& host, size_t wire);
  ~Lane() override = default;

  // Before this lane's first step of an iteration, every bucket of `other`
  // in the same iteration must be done (it is what the next forward needs
  // first, say). `other` must be told of iterations before this lane.
  void gate_on(Lane& other) { gates_.push_back(&other); }
  // `observer` runs on this lane's thread after each step, before the bucket
  // counts as done.
  void observe(Observer observer) { observers_.push_back(std::move(observer)); }

  // ---- the ring's calls (RingListener, iteration_ring.h)
  void rebuild(size_t flights) override;
  // Resets this lane's state for the iteration and submits its work, if it
  // takes it.
  void begin(InFlightIteration& flight) override;
  void packed(const InFlightIteration& flight, size_t bucket) override;
  // By default, waits for the lane's work of the iteration that used
  // `flight` last.
  void release(const InFlightIteration& flight, uint64_t next) const override;
  void wake() override;

  // Under the ring's mutex: this lane's work on the flight in `slot`.
  const Handle& handle(size_t slot) const { return state(slot).handle; }
  // Whether this lane works on `iteration` (fixed while it runs).
  bool active(uint64_t iteration) const;

  // On a lane thread: blocks until bucket `bucket` of `iteration` has this
  // lane's result; false if this lane's work of that iteration ended
  // without it (it failed: engine threads must not rethrow, since a
  // failure's diagnosis may call into a user-provided store). True at once
  // for an iteration the lane skips, or whose flight was reused since.
  bool await(uint64_t iteration, size_t bucket) const;

  bool done(uint64_t iteration, size_t bucket) const override;
  void wait(uint64_t iteration, size_t bucket, void* stream) override;
  void wait_for(uint64_t iteration, const std::vector<size_t>& indices, void* stream) override;
  void wait_iteration(uint64_t iteration, void* stream) override;

 protected:
  // The ring made `flights` new flights (a new plan; nothing in flight).
  virtual void on_rebuild(size_t flights) {}
  // Whether this lane works on the iteration `flight` was just taken for.
  virtual bool takes(const InFlightIteration& flight) const { return true; }
  // Under the ring's mutex, before the work of `flight` is submitted.
  virtual void on_begin(InFlightIteration& flight) {}
  // This lane's work on one iteration, on its thread: before the first
  // bucket, each bucket in issue order, after the last.
  virtual void before(InFlightIteration& flight, Communicator& comm, Timeline& timeline) {}
  virtual void step(InFlightIteration& flight, size_t bucket, Communicator& comm,
                    Timeline& timeline) = 0;
  virtual void after(InFlightIteration& flight, Communicator& comm, Timeline& timeline) {}
  // Where the work of `flight` was at issue position `position` (position
  // == buckets: after the last bucket), for messages.
  virtual std::string where(const InFlightIteration& flight, size_t position) const { return {}; }
  // On a device: whether bucket `bucket`'s result is complete there, and
  // making `stream` wait for it (nothing to do on the host).
  virtual bool complete_on_device(const InFlightIteration& flight, size_t bucket) const {
    return true;
  }
  virtual void wait_on_device(const InFlightIteration& flight, size_t bucket, void* stream) const {}
  // On a device: making `stream` wait for the whole iteration's results.
  virtual void wait_iteration_on_device(const InFlightIteration& flight, void* stream) const {}

  // Whether this lane's step on bucket `bucket` of `flight` has run (on a
  // device: is enqueued), for the iteration that holds the flight now.
  bool flagged(const InFlightIteration& flight, size_t bucket) const {
    return state(flight.slot).done[bucket].load(std::memory_order_acquire);
  }
  // Where tensor `index` lies whole (throws, saying `remedy`, if the plan
  // cut it across buckets: then no one lane buffer holds it).
  const Placement& whole(size_t index, const char* remedy) const;
  const std::string& timeline_lane() const { return timeline_lane_; }
  std::chrono::milliseconds timeout() const;

  const IterationRing& ring_;
  const ReducerPlan& plan_;
  Scheduler& host_;

 private:
  class Walk;
  // A lane's state per flight slot.
  struct PerFlight {
    bool active = false;  // this iteration is worked on (fixed while it runs)
    std::unique_ptr<ReadyQueue<uint32_t>> queue;  // packed buckets
    std::unique_ptr<std::atomic<bool>[]> done;   // per bucket
    // done is set and cv notified under mutex, so waiters never miss it.
    mutable std::mutex mutex;
    mutable std::condition_variable cv;
    Handle handle;
  };

  PerFlight& state(size_t slot) { return *flights_[slot]; }
  const PerFlight& state(size_t slot) const { return *flights_[slot]; }
  void run(InFlightIteration& flight, Communicator& comm, Timeline& timeline, size_t* position);
  void wait_gates(const InFlightIteration& flight, Timeline& timeline) const;
  // Blocks until bucket `bucket` is packed, popping the flight's queue
  // (`ready`: what was popped so far).
  void wait_packed(PerFlight& state, size_t bucket, std::vector<bool>& ready,
                   Timeline& timeline) const;

  const std::string timeline_lane_;
  const std::string what_;
  const size_t wire_;
  std::vector<Lane*> gates_;
  std::vector<Observer> observers_;
  std::vector<std::unique_ptr<PerFlight>> flights_;
};

// Blocks until `done` is set (it is set, and `cv` notified, under `mutex`),
// or until the work of `handle`, which sets it, ends without setting it (it
// failed); returns whether it was set.
bool wait_for_flag(std::mutex& mutex, std::condition_variable& cv, const std::atomic<bool>& done,
                   const Handle& handle);
// Sets `done` under `mutex` and wakes every wait_for_flag on it.
void set_flag(std::mutex& mutex, std::condition_variable& cv, std::atomic<bool>& done);

}  // namespace hemiola
