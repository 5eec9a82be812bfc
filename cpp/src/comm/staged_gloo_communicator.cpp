// Gloo with CUDA tensors: device -> pinned host -> Gloo all-reduce -> device.
//
// The copies run on a copy stream of the communicator's own, fenced against
// the caller's stream by events in both directions, so the caller's stream is
// only ever made to wait on the device. The scheduler thread does block while
// the bytes are on the host: Gloo reduces host memory.
#include <algorithm>

#include "comm/device_communicator.h"
#include "device.h"
#include "engine/dtype_math.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

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
    const TensorRef host{stage, tensor.dtype, tensor.numel, Device{}};
    host_.all_reduce_sum(host);
    if (average && host_.size() > 1) {
      scale_in_place(tensor.dtype, stage, tensor.numel, 1.0 / host_.size());
    }
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

}  // namespace

std::unique_ptr<DeviceCommunicator> make_staged_gloo_communicator(Communicator& host, int device) {
  return std::make_unique<StagedGlooCommunicator>(host, device);
}

}  // namespace hemiola
