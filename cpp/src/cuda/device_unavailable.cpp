// The CUDA runtime view (device.h) in a build without CUDA: no devices, and
// every other call refuses with what to do. Compiled instead of device.cu; it
// also defines the refusal (unavailable.h) that the kernels' stand-ins share.
#include "cuda/device.h"
#include "cuda/unavailable.h"
#include "hemiola/status.h"

namespace hemiola::cuda {

void unavailable() {
  HEMIOLA_THROW(ErrorCode::kInvalidArgument,
                "this build of hemiola has no CUDA support (no nvcc at build time); install "
                "the CUDA toolkit and rebuild to reduce CUDA tensors");
}

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

}  // namespace hemiola::cuda
