// One in-flight iteration's bucket buffers, in host or in CUDA device memory:
// how a gradient gets into its buckets, how a bucket's result gets out to its
// outputs, and how a caller's stream waits for a result. How a bucket travels
// in between is the codec's (engine/codec/codec.h), which reads and writes
// these buffers. The reducer's iteration lifecycle is the same for both
// kinds; everything that depends on where the memory lives is behind this
// interface (host_buckets.cpp, device_buckets.cpp).
//
// Threads: copy_in on producer threads (many at once, for disjoint tensors);
// begin_reductions, await_copies, copy_out and end_reductions on the engine's
// scheduler thread, in that order, once per iteration; reduced() and the
// block_* calls on user threads. begin_iteration runs on the marking side,
// after the storage's previous iteration is done on the host and before any
// copy_in.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/device_communicator.h"
#include "engine/buckets/bucket_plan.h"
#include "hemiola/tensor.h"

namespace hemiola {

class Devices;

// The plan a storage is laid out for. Owned by the reducer; a rebuild of the
// plan replaces every storage along with it, so the references stay valid for
// a storage's whole life.
struct BucketLayout {
  const std::vector<PlannedBucket>& plan;
  const std::vector<std::vector<Placement>>& placement;  // per tensor
  const std::vector<GradSpec>& specs;
};

class BucketStorage {
 public:
  virtual ~BucketStorage() = default;

  const BucketLayout& layout() const { return layout_; }
  // Bucket b's packed elements (host or device memory).
  unsigned char* buffer(size_t b) const { return buffers_[b]; }
  // Bucket b's wire memory (device storage): scratch of the size the codec
  // asked for at creation, or null where it asked for none.
  unsigned char* wire(size_t b) const { return wires_.empty() ? nullptr : wires_[b]; }
  // Host storage: per tensor, whether this rank produced its gradient this
  // iteration (an unused one was copied in as zeros). Empty on a device,
  // whose codings do not ask.
  const std::vector<uint8_t>& used() const { return used_; }
  // Device storage, from begin_reductions on: the engine's communication
  // stream and device communicator of its device (null on the host).
  void* stream() const { return stream_; }
  DeviceCommunicator* device_comm() const { return device_comm_; }

  // A new iteration takes this storage.
  virtual void begin_iteration() {}
  // Tensor `index`'s pieces into their buckets: from `source`, or zeros when
  // !used. `stream` (CUDA): the stream that produced the gradient; the copy
  // is enqueued there.
  virtual void copy_in(size_t index, const void* source, bool used, void* stream) = 0;

  // Before the first bucket of iteration `iteration` is reduced. `previous`:
  // the storage of the iteration before (of the same kind; itself with
  // in_flight 0), or null for the first iteration.
  virtual void begin_reductions(uint64_t iteration, const BucketStorage* previous) {}
  // Before bucket b travels: what reads it next waits for every copy into it
  // (on a device, the engine's stream waits for the copies' events; on the
  // host the copies are done once the bucket is ready).
  virtual void await_copies(size_t b) {}
  // Once bucket b's result is in its buffer: scales it by `scale` (1: not at
  // all; a device's collective averages itself, so 1 only there) and writes
  // each piece's result to `outs[tensor]` where that is not null. Bucket b is
  // then reduced.
  virtual void copy_out(size_t b, const std::vector<void*>& outs, double scale) = 0;
  // After the iteration's last bucket.
  virtual void end_reductions() {}

  // Once copy_out(b) returned: whether bucket b's result is complete where it
  // is read (on a device: executed, not only enqueued).
  virtual bool reduced(size_t b) const { return true; }
  // Makes `stream` wait for bucket b's result, or for the whole iteration's
  // (on the device; nothing to do on the host, where a reduction is
  // synchronous).
  virtual void block_until_reduced(size_t b, void* stream) const {}
  virtual void block_until_done(void* stream) const {}
  // Blocks the host until every reduction and unpack enqueued so far on this
  // storage is complete on the device. Work that is not within `timeout` (a
  // collective whose peer is gone) is cut off by aborting the device
  // communicator, and waited for again.
  virtual void drain_device(std::chrono::milliseconds timeout) {}

 protected:
  explicit BucketStorage(const BucketLayout& layout) : layout_(layout) {}

  const BucketLayout layout_;
  std::vector<unsigned char*> buffers_;  // per bucket
  std::vector<unsigned char*> wires_;    // per bucket (device; empty: no wire memory)
  std::vector<uint8_t> used_;            // per tensor (host)
  // Set by begin_reductions, on the scheduler thread, for this iteration.
  void* stream_ = nullptr;
  DeviceCommunicator* device_comm_ = nullptr;
};

// Host memory, reduced by the host communicator on the scheduler thread.
std::unique_ptr<BucketStorage> make_host_buckets(const BucketLayout& layout);

// Device memory on CUDA device `device`, reduced on the stream of `devices`'
// entry for it by its device communicator. `wire_bytes[b]`: the wire memory
// bucket b's coding needs (empty or 0: none). `timeout`: how long the host
// waits for earlier device work before declaring a rank dead.
std::unique_ptr<BucketStorage> make_device_buckets(const BucketLayout& layout, Devices& devices,
                                                   int device,
                                                   const std::vector<size_t>& wire_bytes,
                                                   std::chrono::milliseconds timeout);

}  // namespace hemiola
