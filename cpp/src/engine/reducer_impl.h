// Reducer internals. See hemiola/reducer.h for the contract.
//
// Concurrency: mark_ready/mark_unused run on autograd threads (many at once);
// the iteration's work runs on the scheduler thread; wait/abort/rebuild on the
// user's thread. Per-iteration state (slot states, pending counts) is reset by
// wait() on the caller's thread after the iteration's work completed, so it
// is stable while the caller inspects it and reset before the next
// iteration's hooks run.
#pragma once

#include <atomic>
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

  void mark_ready(size_t index, const void* data);
  void mark_unused(size_t index);
  std::vector<size_t> unmarked() const;
  bool in_iteration() const { return open_.load(std::memory_order_acquire); }
  void wait();
  void abort(const std::string& reason);
  void copy_out(size_t index, const TensorRef& dst) const;
  std::vector<int> usage() const;
  std::vector<std::vector<size_t>> buckets() const;
  std::vector<size_t> observed_order() const;
  void rebuild_from_observed_order();
  void rebuild(const std::vector<size_t>& order);
  uint64_t iteration() const { return iteration_.load(std::memory_order_acquire); }
  const GradSpec& spec(size_t index) const { return specs_.at(index); }
  size_t size() const { return specs_.size(); }

  // Called by the iteration's work on the scheduler thread.
  void run_iteration(Communicator& comm, Timeline& timeline, uint64_t iteration,
                     size_t* current_bucket);
  std::string describe_pending(size_t from_bucket) const;

 private:
  enum SlotState : uint8_t { kPending = 0, kReady = 1, kUnused = 2 };
  struct Slot {
    size_t bucket = 0;
    size_t offset = 0;  // in elements, within the bucket
    const void* source = nullptr;
    void* out = nullptr;  // where the reduced value goes; null for unused
    std::atomic<uint8_t> state{kPending};
  };
  struct Bucket {
    PlannedBucket plan;
    std::unique_ptr<unsigned char[]> buffer;
    std::atomic<int64_t> pending{0};
  };

  void build(const std::vector<size_t>& order);
  void begin_iteration();
  void claim(size_t index, SlotState state, const void* source);
  void reset_iteration();
  void check_usable() const;

  EngineImpl& engine_;
  const std::vector<GradSpec> specs_;
  const ReducerOptions options_;
  const double scale_;  // 1/world when averaging

  // The plan and its buffers. Replaced only by rebuild(), between iterations.
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::unique_ptr<Slot[]> slots_;
  std::unique_ptr<ReadyQueue<uint32_t>> queue_;
  std::vector<float> usage_;  // 1 per tensor marked ready this iteration; summed over ranks

  // Order recording (first iteration): each hook claims a position.
  std::atomic<bool> recording_;
  std::atomic<size_t> observed_count_{0};
  std::vector<size_t> observed_;

  std::atomic<bool> open_{false};
  std::atomic<bool> aborted_{false};
  std::atomic<uint64_t> iteration_{0};
  mutable std::mutex mutex_;  // guards current_, abort_reason_, begin/rebuild
  Handle current_;
  std::string abort_reason_;
};

}  // namespace hemiola
