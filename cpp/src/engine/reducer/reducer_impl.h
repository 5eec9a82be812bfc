// Reducer internals. See hemiola/reducer.h for the contract.
//
// A reducer composes three things and adds no logic of its own to them:
//   - the plan (ReducerPlan): the gradients, their buckets, the issue order;
//   - the iteration ring (iteration_ring.h): flights, marking, the
//     in-flight bound, and "bucket b of iteration t is packed";
//   - its lanes (lane.h), each told of every packed bucket: the full
//     reduction (reduction_lane.h) always, decoupled's preview
//     (preview_lane.h) with ReducerOptions::preview. Lanes do not know each
//     other's kind; the reducer wires them (who gates on whom, who observes
//     whom) once, here.
// The bucket memory is the BucketStorage's (engine/buckets/bucket_storage.h);
// how a bucket travels, the codec's (engine/codec/codec.h), which the full
// reduction's step calls.
//
// Concurrency: mark() runs on autograd threads (many at once); the lanes'
// work on their scheduler threads; everything else on the user's thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/buckets/bucket_plan.h"
#include "engine/buckets/bucket_storage.h"
#include "engine/codec/codec.h"
#include "engine/reducer/iteration_ring.h"
#include "engine/wire/scheduler.h"
#include "engine/reducer/preview_lane.h"
#include "engine/reducer/reduction_lane.h"
#include "hemiola/config.h"
#include "hemiola/reducer.h"

namespace hemiola {

class ReducerImpl {
 public:
  ReducerImpl(Scheduler& host, std::vector<GradSpec> specs, const ReducerOptions& options);
  ~ReducerImpl();

  // `stream`: on a CUDA reducer, the stream the gradient was produced on
  // (the copy into the bucket is enqueued there); ignored on CPU.
  void mark(size_t index, const void* source, const void* local, void* out, bool used,
            void* stream) {
    ring_.mark(index, source, local, out, used, stream);
  }
  void observe(MarkObserver& observer) { ring_.observe(observer); }
  void forget(MarkObserver& observer) { ring_.forget(observer); }
  std::vector<size_t> unmarked() const { return ring_.unmarked(); }
  bool marking() const { return ring_.marking(); }
  int64_t finish_marking() { return ring_.finish_marking(); }
  // On a CUDA reducer, `stream` is made to wait (on the device) for the
  // result; the host waits only until the reductions are enqueued.
  void wait(uint64_t iteration, void* stream);
  // The tensors' buckets, in issue order (Reducer::wait_for).
  void wait_for(uint64_t iteration, const std::vector<size_t>& indices, void* stream);
  std::vector<size_t> arrived(uint64_t iteration, const std::vector<size_t>& indices) const;
  void wait_all();
  // Reducer::drain.
  void drain(bool abort_marking) noexcept;
  void set_issue_order(const std::vector<size_t>& order);
  std::vector<size_t> issue_order() const;
  void abort(const std::string& reason) { ring_.abort(reason); }
  TensorRef result(uint64_t iteration, size_t index) const {
    return reduction_->value(iteration, index);
  }
  std::vector<int> usage(uint64_t iteration) const;
  size_t pieces(size_t index) const;
  std::vector<std::vector<size_t>> buckets() const;
  std::vector<size_t> observed_order() const { return ring_.observed_order(); }
  void rebuild_from_observed_order();
  void rebuild(const std::vector<size_t>& order);
  uint64_t iterations_started() const { return ring_.started(); }
  const GradSpec& spec(size_t index) const { return plan_.specs.at(index); }
  const Device& device() const { return options_.device; }
  const ReducerOptions& options() const { return options_; }
  size_t size() const { return plan_.specs.size(); }

  ReductionLane& reduction() { return *reduction_; }
  LaneResults* preview() { return preview_.get(); }
  double preview_error() const { return preview_ ? preview_->error() : 0.0; }
  // A coding that keeps residuals (coding(c).residuals): tensor `index`'s
  // error-feedback residual (float32, in the reducer; read and write it only
  // between iterations).
  TensorRef residual(size_t index);
  // Before the first iteration only (Reducer::set_compression).
  void set_compression(Compression compression, size_t powersgd_rank,
                       uint64_t powersgd_start_iteration);

 private:
  void build(const std::vector<size_t>& order);
  std::unique_ptr<BucketStorage> make_storage();
  std::unique_ptr<Codec> make_codec(Compression compression) const;
  // Every lane, in the order the ring tells them of an iteration.
  std::vector<const Lane*> lanes() const;
  // The engine's timeout_s, for the waits of this reducer.
  std::chrono::milliseconds timeout() const;
  bool on_device() const { return options_.device.type == DeviceType::kCUDA; }

  Scheduler& host_;
  ReducerOptions options_;  // fixed, but for compression before the first iteration
  ReducerPlan plan_;
  IterationRing ring_;
  std::unique_ptr<ReductionLane> reduction_;
  std::unique_ptr<PreviewLane> preview_;  // ReducerOptions::preview only
};

}  // namespace hemiola
