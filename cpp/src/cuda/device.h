// Plain C++ view of the CUDA runtime, for engine code compiled without nvcc.
//
// Streams and events travel as void* (a cudaStream_t / cudaEvent_t); nullptr
// is the legacy default stream. Every failure throws hemiola::Error naming the
// call and CUDA's message. In a build without CUDA the same functions exist
// (device_unavailable.cpp) and throw, saying the build lacks CUDA;
// device_count() then returns 0.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace hemiola::cuda {

// Number of usable CUDA devices; 0 with `reason` filled when there are none
// (no driver, no device, ...). Never throws.
int device_count(std::string* reason);

// Makes `device` current on the calling thread (the runtime's state is per
// thread: the engine's scheduler thread sets it before touching a device).
void set_device(int device);

// An engine-owned stream on one device. Non-blocking with respect to the
// legacy default stream, so the user's work on stream 0 never serialises
// with the engine's.
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* get() const { return stream_; }
  int device() const { return device_; }

 private:
  int device_;
  void* stream_ = nullptr;
};

// A synchronisation-only event (no timing) on one device. Until its first
// record() it counts as complete: a stream waiting on it does not wait.
class Event {
 public:
  explicit Event(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  // Captures the work enqueued on `stream` so far.
  void record(void* stream);
  // Makes `stream` wait (on the device) for the captured work.
  void block(void* stream) const;
  // True when the captured work is complete; never waits.
  bool query() const;
  // Waits on the host, polling, until the captured work is complete or
  // `timeout` passes; returns whether it completed.
  bool wait_for(std::chrono::milliseconds timeout) const;
  // Blocks the host until the captured work is complete (as synchronize()
  // does for a stream).
  void synchronize() const;
  void* get() const { return event_; }

 private:
  int device_;
  void* event_ = nullptr;
};

// Device memory, zero-filled when allocated.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory (the staging area of asynchronous copies).
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Enqueues a copy of `bytes` on `stream` (any direction: unified addressing).
void copy_async(void* dst, const void* src, size_t bytes, void* stream);
// Enqueues zero-filling `bytes` at device address `dst` on `stream`.
void zero_async(void* dst, size_t bytes, void* stream);
// Waits on the host for everything enqueued on `stream`.
void synchronize(void* stream);
// The device a pointer's memory lives on, or -1 for host memory.
int device_of(const void* pointer);

}  // namespace hemiola::cuda
