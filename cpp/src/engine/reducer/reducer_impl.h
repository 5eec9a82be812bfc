// Reducer internals. See hemiola/reducer.h for the contract.
//
// The reducer is three parts:
//   - the iteration lifecycle (reducer.cpp): flights, marking, the scheduler's
//     walk over the buckets in issue order, waits, abort and rebuilds;
//   - the bucket storage (bucket_storage.h): host or device buffers, copies
//     in, one bucket's reduction and unpacking, and device-side waits;
//   - the preview lane (reducer_preview.cpp, ReducerOptions::preview) and the
//     diagnostics (reducer_diagnostics.cpp: what an error or a stall names).
//
// Concurrency: mark_ready/mark_unused run on autograd threads (many at once);
// an iteration's work runs on the scheduler thread; finish_marking, wait,
// abort and rebuild on the user's thread.
//
// Each iteration k owns a Flight: its bucket storage, pending counts, slot
// states and a ready queue. Iteration k uses flights_[k % flights_.size()];
// before a flight is reused, the iteration that used it last must be done
// (that is the in-flight bound). A flight's per-iteration state is reset when
// it is taken, on the marking side, after its previous work completed, so the
// scheduler never sees it change underneath.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/buckets/bucket_plan.h"
#include "engine/buckets/bucket_storage.h"
#include "engine/engine_impl.h"
#include "core/ready_queue.h"
#include "engine/codec/codec.h"
#include "engine/reducer/device_setup.h"
#include "hemiola/config.h"
#include "hemiola/reducer.h"

namespace hemiola {

class ReducerImpl {
 public:
  ReducerImpl(EngineImpl& engine, std::vector<GradSpec> specs, const ReducerOptions& options);
  ~ReducerImpl();

  // `stream`: on a CUDA reducer, the stream the gradient was produced on
  // (the copy into the bucket is enqueued there); ignored on CPU.
  void mark(size_t index, const void* source, void* out, bool used, void* stream);
  std::vector<size_t> unmarked() const;
  bool marking() const { return marking_.load(std::memory_order_acquire) != nullptr; }
  int64_t finish_marking();
  // On a CUDA reducer, `stream` is made to wait (on the device) for the
  // result; the host waits only until the reductions are enqueued.
  void wait(uint64_t iteration, void* stream);
  // The tensors' buckets, in issue order (Reducer::wait_for).
  void wait_for(uint64_t iteration, const std::vector<size_t>& indices, void* stream);
  std::vector<size_t> arrived(uint64_t iteration, const std::vector<size_t>& indices) const;
  void wait_all();
  // Waits for every submitted iteration's work to end, successfully or not
  // (never throws), on the host and on the device: afterwards nothing writes
  // to the outputs given to mark(). With `abort_marking`, an iteration still
  // being marked is aborted first (its buckets would never all become ready),
  // and the reducer with it. Device work that does not end within the
  // engine's timeout is cut off by aborting the device communicator.
  void drain(bool abort_marking) noexcept;
  void set_issue_order(const std::vector<size_t>& order);
  std::vector<size_t> issue_order() const;
  void abort(const std::string& reason);
  TensorRef result(uint64_t iteration, size_t index) const;
  std::vector<int> usage(uint64_t iteration) const;
  size_t pieces(size_t index) const;
  std::vector<std::vector<size_t>> buckets() const;
  std::vector<size_t> observed_order() const;
  void rebuild_from_observed_order();
  void rebuild(const std::vector<size_t>& order);
  uint64_t iterations_started() const { return started_.load(std::memory_order_acquire); }
  const GradSpec& spec(size_t index) const { return specs_.at(index); }
  const Device& device() const { return options_.device; }
  const ReducerOptions& options() const { return options_; }
  size_t size() const { return specs_.size(); }

  // ---- per bucket: the engine's own landing logic (the Updater) and tests.
  // Buckets are an internal unit: the public Reducer speaks of tensors.

  // Blocks until bucket `bucket` of `iteration` is reduced (other buckets may
  // still be in flight); throws like wait(). On CUDA, `stream` waits for it
  // on the device.
  void wait_bucket(uint64_t iteration, size_t bucket, void* stream);
  // True once the bucket is reduced (on CUDA: complete on the device). Never blocks.
  bool bucket_done(uint64_t iteration, size_t bucket) const;
  // ReducerOptions::preview: true once bucket `bucket` of `iteration` has its
  // preview (false in iterations that take none; never blocks).
  bool preview_done(uint64_t iteration, size_t bucket) const;
  // Blocks until preview_done (returns at once in an iteration that takes no
  // preview); throws like wait_bucket().
  void wait_preview(uint64_t iteration, size_t bucket);
  // Once preview_done: the rank's estimate of the average of gradient `index`
  // (see ReducerOptions::preview), in the reducer's buffers (valid until
  // iteration + in_flight + 1 starts marking). Not for a partitioned tensor.
  TensorRef preview(uint64_t iteration, size_t index) const;
  double preview_error() const;
  // Compression::kInt8: tensor `index`'s error-feedback residual (float32,
  // in the reducer; read and write it only between iterations).
  TensorRef residual(size_t index);
  // Before the first iteration only (Reducer::set_compression).
  void set_compression(Compression compression, size_t powersgd_rank,
                       uint64_t powersgd_start_iteration);

 private:
  enum SlotState : uint8_t { kPending = 0, kReady = 1, kUnused = 2 };

  // A CPU flight's preview (ReducerOptions::preview), per bucket in plan
  // layout: the codes (all-reduced in place into their sums) and the
  // estimate (the bucket's dtype), both made by the preview lane from the
  // packed gradients, which the main lane leaves alone until the preview is
  // done.
  struct Preview {
    std::vector<std::vector<int8_t>> codes;
    std::vector<std::unique_ptr<unsigned char[]>> estimate;
    bool active = false;  // this iteration takes a preview (fixed while it runs)
    std::unique_ptr<ReadyQueue<uint32_t>> queue;  // ready buckets, for the preview lane
    std::unique_ptr<std::atomic<bool>[]> done;   // per bucket
    std::mutex mutex;                            // done is set and cv notified under it
    std::condition_variable cv;
    Handle handle;  // the preview lane's work (submitted before the main lane's, which waits on it)
  };

  static constexpr uint64_t kNoIteration = ~uint64_t{0};
  // One iteration's state.
  struct Flight {
    uint64_t iteration = kNoIteration;  // the last iteration that took it
    std::unique_ptr<BucketStorage> storage;
    std::unique_ptr<Preview> preview;                  // ReducerOptions::preview only
    std::unique_ptr<std::atomic<int64_t>[]> pending;  // per bucket
    std::unique_ptr<std::atomic<uint8_t>[]> state;    // per tensor (SlotState)
    std::vector<void*> out;                            // per tensor; null: keep only
    std::vector<float> usage;                          // per tensor, summed over ranks
    std::unique_ptr<ReadyQueue<uint32_t>> queue;
    Handle handle;
    // Per bucket: reduced and written back. Set by the scheduler thread;
    // set_flag sets it under bucket_mutex, so waiters never miss it.
    std::unique_ptr<std::atomic<bool>[]> bucket_done;
    std::mutex bucket_mutex;
    std::condition_variable bucket_cv;
  };
  class Work;
  class PreviewWork;

  // ---- lifecycle (reducer.cpp)
  void build(const std::vector<size_t>& order);
  std::unique_ptr<BucketStorage> make_storage();
  std::unique_ptr<Codec> make_codec(Compression compression) const;
  Flight& begin_iteration();
  const Flight& completed_flight(uint64_t iteration) const;
  void check_usable() const;
  // The engine's timeout_s, for the waits of this reducer.
  std::chrono::milliseconds timeout() const;
  void run(Flight& flight, Communicator& comm, Timeline& timeline, size_t* current_bucket);
  // Blocks until bucket `b` is ready on this rank, popping `queue` (a lane's
  // scheduler thread; `ready` is that lane's record of what was popped).
  void wait_ready(ReadyQueue<uint32_t>& queue, size_t b, std::vector<bool>& ready,
                  Timeline& timeline, const char* lane);
  void reduce(Flight& flight, size_t b, Communicator& comm, Timeline& timeline);
  bool on_device() const { return options_.device.type == DeviceType::kCUDA; }

  // ---- preview lane (reducer_preview.cpp)
  std::unique_ptr<Preview> make_preview() const;
  // Submits `flight`'s preview to the engine's preview lane.
  Handle submit_preview(Flight& flight);
  // The preview lane's work for one iteration: each bucket's codes summed,
  // and its estimate finished, in issue order.
  void run_preview(Flight& flight, Communicator& comm, Timeline& timeline);
  // The preview lane: blocks until iteration `iteration` reduced bucket `b`
  // (throws if that reduction failed).
  void wait_reduced(uint64_t iteration, size_t b);
  // The main lane: blocks until every bucket of `flight` has its preview
  // (throws if the preview lane failed).
  void wait_previews(Flight& flight, Timeline& timeline);
  // The main lane, once bucket `b` is averaged: the next iteration's scales,
  // and this iteration's preview error.
  void after_reduced(Flight& flight, size_t b);

  // ---- diagnostics (reducer_diagnostics.cpp)
  // What the iteration's work was doing at issue position `position`.
  std::string describe(size_t position) const;
  // Names of the tensors `indices` (pieces of one tensor named once), at most `limit`.
  std::string names(const std::vector<size_t>& indices, size_t limit = 8) const;

  EngineImpl& engine_;
  const std::vector<GradSpec> specs_;
  ReducerOptions options_;  // fixed, but for compression before the first iteration
  const double scale_;  // 1/world when averaging
  // How every bucket travels (ReducerOptions::compression; never null).
  // Shared by every flight and used on the scheduler thread only.
  std::unique_ptr<Codec> codec_;

  // The plan. Replaced only by rebuild(), with no iteration in flight.
  std::vector<PlannedBucket> plan_;
  std::vector<size_t> issue_order_;  // a permutation of plan_'s indices
  std::vector<std::vector<Placement>> placement_;  // per tensor, its pieces
  std::vector<std::unique_ptr<Flight>> flights_;  // in_flight + 1
  // ReducerOptions::preview: per bucket, one scale per kPreviewBlock elements,
  // from the newest averaged gradient (written by the main lane as each
  // bucket is reduced; iteration k's preview lane reads bucket b's after
  // iteration k - 1 reduced it, and iteration k's main lane writes them
  // only after k's previews are done). Every rank has the same ones.
  std::vector<std::vector<float>> preview_scales_;
  uint64_t plan_start_ = 0;  // the first iteration of the current plan
  // Summed over every previewed bucket so far, as each is fully reduced:
  // squared distance of this rank's estimate from the average, and the
  // average's squared norm (preview_error()).
  mutable std::mutex preview_error_mutex_;
  double preview_distance_ = 0.0;
  double preview_norm_ = 0.0;

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

// Blocks until `done` is set (it is set, and `cv` notified, under `mutex`),
// or until the work of `handle`, which sets it, ends without setting it (it
// failed); returns whether it was set. (User threads then rethrow with
// handle.wait(); engine threads must not, because a failure's diagnosis may
// call into a user-provided store.)
bool wait_for_flag(std::mutex& mutex, std::condition_variable& cv, const std::atomic<bool>& done,
                   const Handle& handle);
// Sets `done` under `mutex` and wakes every wait_for_flag on it.
void set_flag(std::mutex& mutex, std::condition_variable& cv, std::atomic<bool>& done);

// The engine's access to a Reducer's internals (the Updater, tests).
struct ReducerAccess {
  static ReducerImpl& impl(Reducer& reducer) { return *reducer.impl_; }
};

}  // namespace hemiola
