// The updater's own memory and copies on the parameters' device: what the
// landing graph, the policies and the stepper share, so that none of them
// needs another to allocate or copy.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "cuda/device.h"
#include "hemiola/tensor.h"

namespace hemiola {

// Host memory of one tensor's size.
using HostBuffer = std::vector<std::max_align_t>;

void* allocate(HostBuffer& buffer, size_t bytes);

// Memory of the updater's own for one tensor (a shadow parameter, a gathered
// result, a scratch step), on the parameters' device.
class Buffer {
 public:
  // At least `bytes` of memory on `device` (its contents are kept only when
  // no reallocation is needed).
  void* reserve(const Device& device, size_t bytes);
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;  // into host_ or device_
  HostBuffer host_;
  std::unique_ptr<cuda::DeviceBuffer> device_;
};

// A copy on `device` (on a GPU: enqueued on `stream`; nothing for 0 bytes).
void copy_on(const Device& device, StreamRef stream, void* dst, const void* src, size_t bytes);

}  // namespace hemiola
