// The CUDA runtime view (cuda/device.h), the kernels the engine launches
// (cuda::unpack, cast, cast_divide) and the optimizer's GPU steps, in a build
// without CUDA: no devices, and every other call refuses with what to do.
// Compiled instead of cuda/device.cu, so engine code needs no #if around its
// device path.
#include "device.h"
#include "kernels.h"

#include "hemiola/status.h"

namespace hemiola::cuda {

namespace {

[[noreturn]] void unavailable() {
  HEMIOLA_THROW(ErrorCode::kInvalidArgument,
                "this build of hemiola has no CUDA support (no nvcc at build time); install "
                "the CUDA toolkit and rebuild to reduce CUDA tensors");
}

}  // namespace

int device_count(std::string* reason) {
  if (reason) *reason = "built without CUDA";
  return 0;
}

void set_device(int) { unavailable(); }
Stream::Stream(int device) : device_(device) { unavailable(); }
Stream::~Stream() = default;
Event::Event(int device) : device_(device) { unavailable(); }
Event::~Event() = default;
void Event::record(void*) { unavailable(); }
void Event::block(void*) const { unavailable(); }
bool Event::query() const { unavailable(); }
bool Event::wait_for(std::chrono::milliseconds) const { unavailable(); }
void Event::synchronize() const { unavailable(); }
DeviceBuffer::DeviceBuffer(int, size_t) { unavailable(); }
DeviceBuffer::~DeviceBuffer() = default;
PinnedBuffer::PinnedBuffer(size_t) { unavailable(); }
PinnedBuffer::~PinnedBuffer() = default;
void copy_async(void*, const void*, size_t, void*) { unavailable(); }
void zero_async(void*, size_t, void*) { unavailable(); }
void synchronize(void*) { unavailable(); }
int device_of(const void*) { unavailable(); }
void cast(const void*, DType, void*, DType, std::int64_t, void*) { unavailable(); }
void cast_divide(const float*, void*, DType, std::int64_t, float, void*) { unavailable(); }
void unpack(const FusionSlot*, std::int64_t, std::int64_t, DType, const void*, double, void*) {
  unavailable();
}
void sgd_step(const SgdTensors&, std::int64_t, DType, const SgdHyper&, bool, void*) {
  unavailable();
}
void adam_step(const AdamTensors&, std::int64_t, DType, const AdamHyper&, bool, void*) {
  unavailable();
}
void sgd_steps(const SgdStep*, size_t, bool, void*) { unavailable(); }
void adam_steps(const AdamStep*, size_t, bool, void*) { unavailable(); }
void clip_coefficient(const NormInput*, size_t, const std::int32_t*, double*, double, double,
                      double*, void*) {
  unavailable();
}

}  // namespace hemiola::cuda
