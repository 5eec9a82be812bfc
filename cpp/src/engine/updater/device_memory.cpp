// engine/updater/device_memory.h: host and device buffers, and copies.
#include "engine/updater/device_memory.h"

#include <algorithm>
#include <cstring>

namespace hemiola {

void* allocate(HostBuffer& buffer, size_t bytes) {
  buffer.resize((bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t));
  return buffer.data();
}

void* Buffer::reserve(const Device& device, size_t bytes) {
  if (device.type == DeviceType::kCPU) {
    data_ = allocate(host_, bytes);
  } else {
    if (!device_ || device_->size() < bytes) {
      device_ = std::make_unique<cuda::DeviceBuffer>(device.index, std::max<size_t>(bytes, 1));
      // Its zero-fill runs on the legacy default stream, which the user's
      // and the engine's non-blocking streams do not wait for: let it end
      // before either writes here (allocations happen in the first
      // iterations only).
      cuda::synchronize(nullptr);
    }
    data_ = device_->data();
  }
  return data_;
}

void copy_on(const Device& device, StreamRef stream, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    std::memcpy(dst, src, bytes);
  } else {
    cuda::copy_async(dst, src, bytes, stream.handle);
  }
}

}  // namespace hemiola
