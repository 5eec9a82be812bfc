// device.h over the CUDA runtime, compiled with nvcc (device_unavailable.cpp
// stands in for it in a build without CUDA).
#include <cuda_runtime.h>

#include <algorithm>
#include <thread>

#include "cuda/device.h"
#include "hemiola/status.h"

namespace hemiola::cuda {

namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so later calls are not blamed
    HEMIOLA_THROW(ErrorCode::kInternal, call, " failed: ", cudaGetErrorName(status), ": ",
                  cudaGetErrorString(status));
  }
}
#define HEMIOLA_CUDA(call) check((call), #call)

// Makes `device` current for the lifetime of the guard (events and streams
// belong to the device that is current when they are created).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    HEMIOLA_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) HEMIOLA_CUDA(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  int device_ = 0;
};

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

int device_count(std::string* reason) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    // Without a GPU driver this is cudaErrorInsufficientDriver (35): "no GPU".
    if (reason) *reason = cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  if (count == 0 && reason) *reason = "no CUDA device";
  return count;
}

void set_device(int device) { HEMIOLA_CUDA(cudaSetDevice(device)); }

Stream::Stream(int device) : device_(device) {
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  HEMIOLA_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
}

Stream::~Stream() {
  if (stream_) cudaStreamDestroy(as_stream(stream_));
}

Event::Event(int device) : device_(device) {
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  HEMIOLA_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  event_ = event;
}

Event::~Event() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

void Event::record(void* stream) {
  HEMIOLA_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(event_), as_stream(stream)));
}

void Event::block(void* stream) const {
  HEMIOLA_CUDA(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event_), 0));
}

bool Event::query() const {
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  HEMIOLA_CUDA(status);
  return true;
}

void Event::synchronize() const {
  HEMIOLA_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
}

bool Event::wait_for(std::chrono::milliseconds timeout) const {
  // Polled rather than cudaEventSynchronize: a device that never finishes
  // (a peer's NCCL kernel waiting forever) must not hang the engine thread.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(5);
  while (!query()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return true;
}

DeviceBuffer::DeviceBuffer(int device, size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  HEMIOLA_CUDA(cudaMalloc(&data_, bytes));
  HEMIOLA_CUDA(cudaMemset(data_, 0, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) HEMIOLA_CUDA(cudaMallocHost(&data_, bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) cudaFreeHost(data_);
}

void copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return;
  HEMIOLA_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
}

void zero_async(void* dst, size_t bytes, void* stream) {
  if (bytes == 0) return;
  HEMIOLA_CUDA(cudaMemsetAsync(dst, 0, bytes, as_stream(stream)));
}

void synchronize(void* stream) { HEMIOLA_CUDA(cudaStreamSynchronize(as_stream(stream))); }

int device_of(const void* pointer) {
  cudaPointerAttributes attributes{};
  HEMIOLA_CUDA(cudaPointerGetAttributes(&attributes, pointer));
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged
             ? attributes.device
             : -1;
}

}  // namespace hemiola::cuda
