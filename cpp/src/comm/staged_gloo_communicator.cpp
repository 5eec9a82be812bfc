// Gloo with CUDA tensors: device -> pinned host -> Gloo all-reduce -> device.
//
// The copies run on copy streams of the communicator's own, fenced against
// the caller's stream by events in both directions, so the caller's stream is
// only ever made to wait on the device. The scheduler thread does block while
// the bytes are on the host: Gloo reduces host memory.
//
// Two implementations. StagedGlooCommunicator stages a reduction whole: the
// link idles while the bucket is copied down and averaged, and the copies idle
// while it is on the wire. PipelinedStagedGlooCommunicator cuts it into chunks
// that rotate through a ring of pinned stages: while chunk k is reduced over
// Gloo, chunks k+1.. are being copied down and chunk k-1 up, on two streams
// (PCIe is full duplex), and the ring carries over to the next bucket.
#include <algorithm>
#include <array>

#include "comm/device_communicator.h"
#include "core/dtype_math.h"
#include "cuda/device.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

// The host part of a staged reduction: `staged` summed over every rank by
// Gloo, then (with `average`) divided by the rank count.
void reduce_on_host(Communicator& host, const TensorRef& staged, bool average) {
  host.all_reduce_sum(staged);
  if (average && host.size() > 1) {
    scale_in_place(staged.dtype, staged.data, staged.numel, 1.0 / host.size());
  }
}

class StagedGlooCommunicator final : public DeviceCommunicator {
 public:
  StagedGlooCommunicator(Communicator& host, int device)
      : host_(host), copy_(device), inputs_ready_(device), result_ready_(device) {}

  std::string name() const override { return "gloo (CUDA tensors staged through pinned memory)"; }

  void all_reduce(const TensorRef& tensor, bool average, void* stream) override {
    HEMIOLA_CHECK(tensor.device.type == DeviceType::kCUDA, "staged all_reduce of a host tensor");
    if (tensor.numel == 0) return;
    const size_t bytes = tensor.nbytes();
    if (!stage_ || stage_->size() < bytes) {
      cuda::synchronize(copy_.get());  // an earlier copy may still read the old stage
      stage_ = std::make_unique<cuda::PinnedBuffer>(std::max(bytes, size_t{1} << 20));
    }
    void* stage = stage_->data();
    inputs_ready_.record(stream);
    inputs_ready_.block(copy_.get());
    cuda::copy_async(stage, tensor.data, bytes, copy_.get());
    cuda::synchronize(copy_.get());
    reduce_on_host(host_, TensorRef{stage, tensor.dtype, tensor.numel, Device{}}, average);
    cuda::copy_async(tensor.data, stage, bytes, copy_.get());
    result_ready_.record(copy_.get());
    result_ready_.block(stream);
  }

 private:
  Communicator& host_;
  cuda::Stream copy_;
  cuda::Event inputs_ready_;
  cuda::Event result_ready_;
  std::unique_ptr<cuda::PinnedBuffer> stage_;
};

class PipelinedStagedGlooCommunicator final : public DeviceCommunicator {
 public:
  PipelinedStagedGlooCommunicator(Communicator& host, int device, size_t chunk_bytes)
      : host_(host),
        chunk_bytes_(chunk_bytes),
        down_(device),
        up_(device),
        inputs_ready_(device),
        result_ready_(device),
        downloaded_{cuda::Event(device), cuda::Event(device), cuda::Event(device)},
        uploaded_{cuda::Event(device), cuda::Event(device), cuda::Event(device)} {
    HEMIOLA_CHECK(chunk_bytes >= 64, "staged_chunk_bytes ", chunk_bytes, " is below 64");
    for (auto& stage : stages_) stage = std::make_unique<cuda::PinnedBuffer>(chunk_bytes);
  }

  std::string name() const override {
    return "gloo (CUDA tensors staged through pinned memory, pipelined in chunks of " +
           std::to_string(chunk_bytes_) + " bytes)";
  }

  void all_reduce(const TensorRef& tensor, bool average, void* stream) override {
    HEMIOLA_CHECK(tensor.device.type == DeviceType::kCUDA, "staged all_reduce of a host tensor");
    if (tensor.numel == 0) return;
    const size_t elem = dtype_size(tensor.dtype);
    // Chunks hold whole elements; every rank cuts the same tensor alike.
    const size_t chunk_elems = std::max<size_t>(chunk_bytes_ / elem, 1);
    const size_t chunks = (tensor.numel + chunk_elems - 1) / chunk_elems;
    auto* device = static_cast<unsigned char*>(tensor.data);
    const auto count_of = [&](size_t k) {
      return std::min(chunk_elems, tensor.numel - k * chunk_elems);
    };
    const auto stage_of = [&](size_t k) { return (first_stage_ + k) % kStages; };
    // Enqueues chunk k's copy down into its stage, once the stage's previous
    // upload (of this or an earlier reduction) has read it: a device wait.
    const auto download = [&](size_t k) {
      const size_t s = stage_of(k);
      uploaded_[s].block(down_.get());
      cuda::copy_async(stages_[s]->data(), device + k * chunk_elems * elem, count_of(k) * elem,
                       down_.get());
      downloaded_[s].record(down_.get());
    };

    inputs_ready_.record(stream);
    inputs_ready_.block(down_.get());
    for (size_t k = 0; k < std::min(chunks, kStages); ++k) download(k);
    for (size_t k = 0; k < chunks; ++k) {
      const size_t s = stage_of(k);
      downloaded_[s].synchronize();
      reduce_on_host(host_, TensorRef{stages_[s]->data(), tensor.dtype, count_of(k), Device{}},
                     average);
      cuda::copy_async(device + k * chunk_elems * elem, stages_[s]->data(), count_of(k) * elem,
                       up_.get());
      uploaded_[s].record(up_.get());
      if (k + kStages < chunks) download(k + kStages);
    }
    first_stage_ = stage_of(chunks);
    result_ready_.record(up_.get());
    result_ready_.block(stream);
  }

 private:
  static constexpr size_t kStages = 3;

  Communicator& host_;
  const size_t chunk_bytes_;
  cuda::Stream down_;  // device -> stage copies
  cuda::Stream up_;    // stage -> device copies
  cuda::Event inputs_ready_;
  cuda::Event result_ready_;
  // Per stage: its download (host waits on it before the reduction) and its
  // upload (the next download into the stage waits on it, on the device).
  std::array<cuda::Event, kStages> downloaded_;
  std::array<cuda::Event, kStages> uploaded_;
  std::array<std::unique_ptr<cuda::PinnedBuffer>, kStages> stages_;
  size_t first_stage_ = 0;  // the stage the next reduction's first chunk uses
};

}  // namespace

std::unique_ptr<DeviceCommunicator> make_staged_gloo_communicator(Communicator& host, int device,
                                                                  size_t chunk_bytes) {
  if (chunk_bytes > 0) {
    return std::make_unique<PipelinedStagedGlooCommunicator>(host, device, chunk_bytes);
  }
  return std::make_unique<StagedGlooCommunicator>(host, device);
}

}  // namespace hemiola
