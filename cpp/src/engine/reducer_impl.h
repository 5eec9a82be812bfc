// Reducer internals. See hemiola/reducer.h for the contract.
//
// Concurrency: mark_ready/mark_unused run on autograd threads (many at once);
// an iteration's work runs on the scheduler thread; finish_marking, wait,
// abort and rebuild on the user's thread.
//
// Each iteration k owns a Flight: bucket buffers, pending counts, slot states
// and a ready queue. Iteration k uses flights_[k % flights_.size()]; before a
// flight is reused, the iteration that used it last must be done (that is the
// in-flight bound). A flight's per-iteration state is reset when it is taken,
// on the marking side, after its previous work completed, so the scheduler
// never sees it change underneath.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/bucket_plan.h"
#include "engine/engine_impl.h"
#include "engine/ready_queue.h"
#include "hemiola/config.h"
#include "hemiola/reducer.h"

namespace hemiola {

class ReducerImpl {
 public:
  ReducerImpl(EngineImpl& engine, std::vector<GradSpec> specs, const ReducerOptions& options);
  ~ReducerImpl();

  void mark(size_t index, const void* source, void* out, bool used);
  std::vector<size_t> unmarked() const;
  bool marking() const { return marking_.load(std::memory_order_acquire) != nullptr; }
  int64_t finish_marking();
  void wait(uint64_t iteration);
  void wait_bucket(uint64_t iteration, size_t bucket);
  bool bucket_done(uint64_t iteration, size_t bucket) const;
  void wait_all();
  void set_issue_order(const std::vector<size_t>& order);
  std::vector<size_t> issue_order() const;
  void abort(const std::string& reason);
  TensorRef result(uint64_t iteration, size_t index) const;
  std::vector<int> usage(uint64_t iteration) const;
  std::vector<std::vector<size_t>> buckets() const;
  std::vector<size_t> observed_order() const;
  void rebuild_from_observed_order();
  void rebuild(const std::vector<size_t>& order);
  uint64_t iterations_started() const { return started_.load(std::memory_order_acquire); }
  const GradSpec& spec(size_t index) const { return specs_.at(index); }
  size_t size() const { return specs_.size(); }

 private:
  enum SlotState : uint8_t { kPending = 0, kReady = 1, kUnused = 2 };
  // Where a piece of tensor i lives in the plan (one piece unless the tensor
  // is partitioned).
  struct Placement {
    size_t bucket = 0;
    size_t offset = 0;  // in elements, within the bucket
    size_t begin = 0;   // first element of the piece within the tensor
    size_t count = 0;   // elements in the piece
  };
  // One iteration's state.
  struct Flight {
    uint64_t iteration = 0;
    std::vector<std::unique_ptr<unsigned char[]>> buffers;  // per bucket
    std::unique_ptr<std::atomic<int64_t>[]> pending;        // per bucket
    std::unique_ptr<std::atomic<uint8_t>[]> state;          // per tensor (SlotState)
    std::vector<void*> out;                                  // per tensor; null: keep only
    std::vector<float> usage;                                // per tensor, summed over ranks
    std::unique_ptr<ReadyQueue<uint32_t>> queue;
    Handle handle;
    // Per bucket: reduced and written back. Set by the scheduler thread;
    // bucket_cv is notified under bucket_mutex so waiters never miss it.
    std::unique_ptr<std::atomic<bool>[]> bucket_done;
    std::mutex bucket_mutex;
    std::condition_variable bucket_cv;
  };
  class Work;

  void build(const std::vector<size_t>& order);
  Flight& begin_iteration();
  const Flight& completed_flight(uint64_t iteration) const;
  void check_usable() const;
  void run(Flight& flight, Communicator& comm, Timeline& timeline, size_t* current_bucket);
  std::string describe(const Flight& flight, size_t from_bucket) const;

  EngineImpl& engine_;
  const std::vector<GradSpec> specs_;
  const ReducerOptions options_;
  const double scale_;  // 1/world when averaging

  // The plan. Replaced only by rebuild(), with no iteration in flight.
  std::vector<PlannedBucket> plan_;
  std::vector<size_t> issue_order_;  // a permutation of plan_'s indices
  std::vector<std::vector<Placement>> placement_;  // per tensor, its pieces
  std::vector<std::unique_ptr<Flight>> flights_;  // in_flight + 1

  std::atomic<Flight*> marking_{nullptr};  // the iteration being marked, if any
  std::atomic<uint64_t> started_{0};

  // Order recording (first iteration): each hook claims a position.
  std::atomic<bool> recording_;
  std::atomic<size_t> observed_count_{0};
  std::vector<size_t> observed_;

  // Guards taking and releasing flights (begin, finish, rebuild). May be held
  // while waiting for an earlier iteration's work, so that work must never
  // take it.
  mutable std::mutex mutex_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mutex_;  // guards abort_reason_
  std::string abort_reason_;
};

}  // namespace hemiola
