// Buckets in CUDA device memory. Nothing here makes the host wait for the
// device in the steady state: a gradient's copy is enqueued on the stream
// that produced it and recorded as an event; the engine's stream waits for
// those events, the bucket is reduced there (by its codec, engine/codec) and
// unpacked; a caller's stream waits for the bucket's (or the iteration's)
// event. The host waits only where host memory would otherwise be
// overwritten under the device, and as the watchdog of work it never waits
// for (begin_reductions).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "comm/devices.h"
#include "core/dtype_math.h"
#include "cuda/device.h"
#include "engine/buckets/bucket_storage.h"
#include "engine/buckets/unpack_kernel.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

class DeviceBuckets final : public BucketStorage {
 public:
  DeviceBuckets(const BucketLayout& layout, Devices& devices, int device,
                const std::vector<size_t>& wire_bytes, std::chrono::milliseconds timeout)
      : BucketStorage(layout), devices_(devices), device_(device), timeout_(timeout) {
    for (size_t b = 0; b < layout_.plan.size(); ++b) {
      const PlannedBucket& bucket = layout_.plan[b];
      // Zero-filled, as on the host.
      storage_.push_back(
          std::make_unique<cuda::DeviceBuffer>(device, std::max<size_t>(bucket.nbytes(), 1)));
      buffers_.push_back(static_cast<unsigned char*>(storage_.back()->data()));
      const size_t wire = b < wire_bytes.size() ? wire_bytes[b] : 0;
      wire_storage_.push_back(wire > 0 ? std::make_unique<cuda::DeviceBuffer>(device, wire)
                                       : nullptr);
      wires_.push_back(wire > 0 ? static_cast<unsigned char*>(wire_storage_.back()->data())
                                : nullptr);
      reduced_.push_back(std::make_unique<cuda::Event>(device));
      const size_t slot_bytes =
          std::max<size_t>(bucket.tensors.size(), 1) * sizeof(cuda::FusionSlot);
      slots_host_.push_back(std::make_unique<cuda::PinnedBuffer>(slot_bytes));
      slots_device_.push_back(std::make_unique<cuda::DeviceBuffer>(device, slot_bytes));
    }
    uploaded_.assign(layout_.plan.size(), {});
    for (size_t i = 0; i < layout_.specs.size(); ++i) {
      marked_.push_back(std::make_unique<cuda::Event>(device));
    }
    done_ = std::make_unique<cuda::Event>(device);
  }

  void begin_iteration() override { fenced_.store(kNoStream, std::memory_order_relaxed); }

  void copy_in(size_t index, const void* source, bool used, void* stream) override {
    const GradSpec& spec = layout_.specs[index];
    if (used && !checked_.load(std::memory_order_relaxed) && spec.numel > 0) {
      // In this storage's first iteration only (the query costs a driver
      // call): a host gradient would otherwise fail inside a copy, unnamed.
      const int device = cuda::device_of(source);
      HEMIOLA_CHECK(device == device_, "gradient '", spec.name, "' is on ",
                    device < 0 ? std::string("the host") : "CUDA device " + std::to_string(device),
                    " but the reducer is on CUDA device ", device_,
                    "; every gradient of a model must be on the model's device");
    }
    // The caller's stream must not overwrite these buffers while the previous
    // iteration that used them may still read them: it waits for that, on
    // the device, once per iteration and stream.
    const auto id = reinterpret_cast<std::uintptr_t>(stream);
    if (fenced_.exchange(id, std::memory_order_acq_rel) != id) done_->block(stream);
    const size_t elem = dtype_size(spec.dtype);
    for (const Placement& piece : layout_.placement[index]) {
      unsigned char* dst = buffers_[piece.bucket] + piece.offset * elem;
      if (used) {
        cuda::copy_async(dst, static_cast<const unsigned char*>(source) + piece.begin * elem,
                         piece.count * elem, stream);
      } else {
        cuda::zero_async(dst, piece.count * elem, stream);
      }
    }
    // Recorded before the reducer's pending counts drop, so the scheduler,
    // which may pop the bucket right after, always finds the event recorded.
    marked_[index]->record(stream);
  }

  void begin_reductions(uint64_t iteration, const BucketStorage* previous) override {
    cuda::set_device(device_);
    Devices::Entry& entry = devices_.get(device_);
    device_comm_ = entry.comm.get();
    stream_ = entry.stream.get();
    device_comm_->check();
    if (previous == nullptr) return;
    // Every storage of a reducer is of the same kind.
    const auto& before = static_cast<const DeviceBuckets&>(*previous);
    if (!before.done_->wait_for(timeout_)) {
      device_comm_->check();  // an NCCL error, if there is one, says more than the timeout
      device_comm_->abort();
      HEMIOLA_THROW(ErrorCode::kTimeout, "the reductions of iteration ", iteration - 1,
                    " did not complete on CUDA device ", device_, " within ", seconds(), " s (",
                    device_comm_->name(), "): a rank died or stalled, or the device hangs");
    }
  }

  void await_copies(size_t b) override {
    const PlannedBucket& plan = layout_.plan[b];
    // The engine's stream waits, on the device, for every copy into the bucket.
    for (size_t k = 0; k < plan.tensors.size(); ++k) {
      if (k == 0 || plan.tensors[k] != plan.tensors[k - 1]) {
        marked_[plan.tensors[k]]->block(stream_);
      }
    }
  }

  void copy_out(size_t b, const std::vector<void*>& outs, double scale) override {
    HEMIOLA_CHECK(scale == 1.0, "internal: a device bucket is averaged by its collective");
    const PlannedBucket& plan = layout_.plan[b];
    // Averaged in the reduction itself (or by the wire's division); results
    // with an output go there in one unpack launch.
    const size_t elem = dtype_size(plan.dtype);
    std::vector<void*> targets;
    std::vector<cuda::FusionSlot> slots;
    for (size_t k = 0; k < plan.tensors.size(); ++k) {
      auto* out = static_cast<unsigned char*>(outs[plan.tensors[k]]);
      if (out == nullptr) continue;
      targets.push_back(out);
      slots.push_back({out + plan.begins[k] * elem, static_cast<std::int64_t>(plan.offsets[k]),
                       static_cast<std::int64_t>(plan.counts[k])});
    }
    if (!slots.empty()) {
      if (targets != uploaded_[b]) {
        // The pinned slots may still be read by this storage's previous upload.
        if (!done_->wait_for(timeout_)) {
          HEMIOLA_THROW(ErrorCode::kTimeout, "an earlier iteration's reductions did not complete "
                        "on CUDA device ", device_, " within ", seconds(), " s");
        }
        const size_t bytes = slots.size() * sizeof(cuda::FusionSlot);
        std::memcpy(slots_host_[b]->data(), slots.data(), bytes);
        cuda::copy_async(slots_device_[b]->data(), slots_host_[b]->data(), bytes, stream_);
        uploaded_[b] = targets;
      }
      const cuda::FusionSlot& last = slots.back();
      cuda::unpack(static_cast<const cuda::FusionSlot*>(slots_device_[b]->data()),
                   static_cast<std::int64_t>(slots.size()), last.offset + last.numel, plan.dtype,
                   buffers_[b], 1.0, stream_);
    }
    reduced_[b]->record(stream_);
  }

  void end_reductions() override {
    done_->record(stream_);
    checked_.store(true, std::memory_order_relaxed);
    device_comm_->check();
  }

  bool reduced(size_t b) const override { return reduced_[b]->query(); }
  void block_until_reduced(size_t b, void* stream) const override { reduced_[b]->block(stream); }
  void block_until_done(void* stream) const override { done_->block(stream); }
  void drain_device(std::chrono::milliseconds timeout) override {
    if (complete(timeout) || device_comm_ == nullptr) return;
    device_comm_->abort();  // NCCL's kernels of an unfinished collective end with it
    complete(timeout);
  }

 private:
  static constexpr std::uintptr_t kNoStream = ~std::uintptr_t{0};
  // Whether the work enqueued so far completed on the device within
  // `timeout` (per bucket too: an iteration that failed midway recorded no done_).
  bool complete(std::chrono::milliseconds timeout) const {
    for (const auto& event : reduced_) {
      if (!event->wait_for(timeout)) return false;
    }
    return done_->wait_for(timeout);
  }
  double seconds() const { return static_cast<double>(timeout_.count()) / 1000.0; }

  Devices& devices_;
  const int device_;
  const std::chrono::milliseconds timeout_;

  std::vector<std::unique_ptr<cuda::DeviceBuffer>> storage_;  // per bucket
  // Per bucket: its coding's wire memory (half precision: its float32
  // bucket's cast), or null when it travels as it is.
  std::vector<std::unique_ptr<cuda::DeviceBuffer>> wire_storage_;
  // Per tensor: recorded on the producer's stream after its copy in; the
  // engine's stream waits on it before reducing the tensor's buckets.
  std::vector<std::unique_ptr<cuda::Event>> marked_;
  std::vector<std::unique_ptr<cuda::Event>> reduced_;  // per bucket: reduced and unpacked
  std::unique_ptr<cuda::Event> done_;                  // the whole iteration
  // The producer stream that already waits for this storage's previous use
  // (kNoStream: none yet this iteration).
  std::atomic<std::uintptr_t> fenced_{kNoStream};
  // Gradients' devices were checked (the first iteration is over).
  std::atomic<bool> checked_{false};
  // Per bucket, the fusion slots of the outputs to unpack into: written on
  // the host (pinned) and uploaded only when the outputs change.
  std::vector<std::unique_ptr<cuda::PinnedBuffer>> slots_host_;
  std::vector<std::unique_ptr<cuda::DeviceBuffer>> slots_device_;
  std::vector<std::vector<void*>> uploaded_;  // per bucket: the outputs in slots_device_
};

}  // namespace

std::unique_ptr<BucketStorage> make_device_buckets(const BucketLayout& layout, Devices& devices,
                                                   int device,
                                                   const std::vector<size_t>& wire_bytes,
                                                   std::chrono::milliseconds timeout) {
  return std::make_unique<DeviceBuckets>(layout, devices, device, wire_bytes, timeout);
}

}  // namespace hemiola
