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
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device.h"
#include "engine/bucket_plan.h"
#include "comm/device_communicator.h"
#include "engine/engine_impl.h"
#include "engine/ready_queue.h"
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
  void wait_bucket(uint64_t iteration, size_t bucket, void* stream);
  bool bucket_done(uint64_t iteration, size_t bucket) const;
  void wait_all();
  void set_issue_order(const std::vector<size_t>& order);
  std::vector<size_t> issue_order() const;
  void abort(const std::string& reason);
  TensorRef result(uint64_t iteration, size_t index) const;
  bool preview_done(uint64_t iteration, size_t bucket) const;
  void wait_preview(uint64_t iteration, size_t bucket);
  TensorRef preview(uint64_t iteration, size_t index) const;
  double preview_error() const;
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
  // A CUDA flight's device state. The events order work across streams on
  // the device: the caller's stream never waits on the host.
  struct DeviceFlight {
    std::vector<std::unique_ptr<cuda::DeviceBuffer>> buffers;  // per bucket
    // Per tensor: recorded on the caller's stream after its copy into the
    // buckets; the engine's stream waits on it before reducing the bucket.
    std::vector<std::unique_ptr<cuda::Event>> marked;
    std::vector<std::unique_ptr<cuda::Event>> reduced;  // per bucket: reduced and unpacked
    std::unique_ptr<cuda::Event> done;                 // the whole iteration
    // The caller stream that already waits for the flight's previous use
    // (kNoStream: none yet this iteration).
    std::atomic<std::uintptr_t> fenced{kNoStream};
    // Per bucket, the fusion slots of the outputs to unpack into: written on
    // the host (pinned) and uploaded only when the outputs change.
    std::vector<std::unique_ptr<cuda::PinnedBuffer>> slots_host;
    std::vector<std::unique_ptr<cuda::DeviceBuffer>> slots_device;
    std::vector<std::vector<void*>> uploaded;  // per bucket: the outputs in slots_device
  };
  static constexpr std::uintptr_t kNoStream = ~std::uintptr_t{0};

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

  // One iteration's state.
  struct Flight {
    uint64_t iteration = 0;
    std::vector<unsigned char*> buffers;                     // per bucket (host or device)
    std::vector<std::unique_ptr<unsigned char[]>> host_buffers;  // CPU: their storage
    std::unique_ptr<DeviceFlight> gpu;                       // CUDA only
    std::unique_ptr<Preview> preview;                        // ReducerOptions::preview only
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
  std::unique_ptr<DeviceFlight> make_device_flight() const;
  void copy_in_on_device(Flight& flight, size_t index, const void* source, bool used,
                         void* stream);
  const Flight& completed_flight(uint64_t iteration) const;
  void check_usable() const;
  // The engine's timeout_s, for the waits of this reducer.
  std::chrono::milliseconds timeout() const;
  void run(Flight& flight, Communicator& comm, Timeline& timeline, size_t* current_bucket);
  // Blocks until bucket `b` is ready on this rank, popping `queue` (a lane's
  // scheduler thread; `ready` is that lane's record of what was popped).
  void wait_ready(ReadyQueue<uint32_t>& queue, size_t b, std::vector<bool>& ready,
                  Timeline& timeline, const char* lane);
  // The bucket's full-precision reduction (on the host, or enqueued on CUDA).
  void reduce(Flight& flight, size_t b, Communicator& comm, Timeline& timeline,
              DeviceCommunicator* device_comm, void* stream);
  // The preview lane's work for one iteration: each bucket's codes summed,
  // and its estimate finished, in issue order.
  void run_preview(Flight& flight, Communicator& comm, Timeline& timeline);
  // The preview lane: blocks until iteration `iteration` reduced bucket `b`
  // (throws if that reduction failed).
  void wait_reduced(uint64_t iteration, size_t b);
  // The main lane: blocks until every bucket of `flight` has its preview
  // (throws if the preview lane failed).
  void wait_previews(Flight& flight, Timeline& timeline);
  class PreviewWork;
  // CUDA: the bucket's reduction and unpacking, enqueued on the engine's stream.
  void reduce_on_device(Flight& flight, size_t bucket, DeviceCommunicator& comm, void* stream);
  // CUDA: throws if the iteration before `flight`'s has not completed on the
  // device within the timeout (the watchdog of work the host never waits for).
  void check_previous_done(const Flight& flight, DeviceCommunicator& comm) const;
  bool on_device() const { return options_.device.type == DeviceType::kCUDA; }
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

}  // namespace hemiola
