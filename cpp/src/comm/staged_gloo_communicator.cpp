// Gloo with CUDA tensors: device -> pinned host -> Gloo all-reduce -> device.
//
// The copies run on streams of the communicator's own, fenced against the
// caller's stream by events in both directions, so the caller's stream is only
// ever made to wait on the device. The scheduler thread does block while the
// bytes are on the host: Gloo reduces host memory.
//
// Two pinned stages, used in turn, and separate download and upload streams:
// the upload of one reduction and the download of the next run side by side,
// and the host's part (the Gloo reduction) is only the sum. Averaging is a
// kernel on the device after the upload, not a pass over host memory on the
// scheduler thread (which would hold back the next bucket's reduction).
#include <algorithm>
#include <array>

#include "comm/device_communicator.h"
#include "device.h"
#include "hemiola/status.h"
#include "kernels.h"

namespace hemiola {

namespace {

class StagedGlooCommunicator final : public DeviceCommunicator {
 public:
  StagedGlooCommunicator(Communicator& host, int device)
      : host_(host), download_(device), upload_(device), inputs_ready_(device),
        result_ready_(device), stages_{Stage(device), Stage(device)} {}

  std::string name() const override { return "gloo (CUDA tensors staged through pinned memory)"; }

  void all_reduce(const TensorRef& tensor, bool average, void* stream) override {
    HEMIOLA_CHECK(tensor.device.type == DeviceType::kCUDA, "staged all_reduce of a host tensor");
    if (tensor.numel == 0) return;
    const size_t bytes = tensor.nbytes();
    Stage& stage = stages_[next_];
    next_ = 1 - next_;
    if (!stage.buffer || stage.buffer->size() < bytes) {
      cuda::synchronize(upload_.get());  // the old stage's last upload may still read it
      stage.buffer = std::make_unique<cuda::PinnedBuffer>(std::max(bytes, size_t{1} << 20));
    }
    void* host = stage.buffer->data();
    // Invariant: the download into this stage starts after the caller's
    // stream produced the input and after this stage's previous upload read it.
    inputs_ready_.record(stream);
    inputs_ready_.block(download_.get());
    stage.uploaded.block(download_.get());
    cuda::copy_async(host, tensor.data, bytes, download_.get());
    cuda::synchronize(download_.get());
    host_.all_reduce_sum(TensorRef{host, tensor.dtype, tensor.numel, Device{}});
    cuda::copy_async(tensor.data, host, bytes, upload_.get());
    stage.uploaded.record(upload_.get());
    if (average && host_.size() > 1) {
      cuda::scale(tensor.data, tensor.dtype, static_cast<std::int64_t>(tensor.numel),
                  1.0 / host_.size(), upload_.get());
    }
    result_ready_.record(upload_.get());
    result_ready_.block(stream);
  }

 private:
  struct Stage {
    explicit Stage(int device) : uploaded(device) {}
    std::unique_ptr<cuda::PinnedBuffer> buffer;
    cuda::Event uploaded;  // the upload from `buffer` finished (never recorded: no-op)
  };

  Communicator& host_;
  cuda::Stream download_;
  cuda::Stream upload_;
  cuda::Event inputs_ready_;
  cuda::Event result_ready_;
  std::array<Stage, 2> stages_;
  size_t next_ = 0;  // the stage the next reduction uses
};

}  // namespace

std::unique_ptr<DeviceCommunicator> make_staged_gloo_communicator(Communicator& host, int device) {
  return std::make_unique<StagedGlooCommunicator>(host, device);
}

}  // namespace hemiola
