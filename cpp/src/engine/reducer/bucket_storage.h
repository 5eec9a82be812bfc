// One in-flight iteration's bucket buffers, in host or in CUDA device memory:
// how a gradient gets into its buckets, how a bucket is reduced and its
// results written out, and how a caller's stream waits for a result. The
// reducer's iteration lifecycle (reducer.cpp) is the same for both kinds;
// everything that depends on where the memory lives is behind this interface
// (host_buckets.cpp, device_buckets.cpp).
//
// Threads: copy_in on producer threads (many at once, for disjoint tensors);
// begin_reductions, reduce and end_reductions on the engine's scheduler
// thread, in that order, once per iteration; reduced() and the block_*
// calls on user threads. begin_iteration runs on the marking side, after the
// storage's previous iteration is done on the host and before any copy_in.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "engine/buckets/bucket_plan.h"
#include "hemiola/reducer.h"

namespace hemiola {

class LaneHost;

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

  // Bucket b's packed elements (host or device memory).
  unsigned char* buffer(size_t b) const { return buffers_[b]; }

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
  // All-reduces bucket b (averaged if the reducer averages) and writes each
  // piece's result to `outs[tensor]` where that is not null. `host`: the
  // scheduler's host communicator.
  virtual void reduce(size_t b, const std::vector<void*>& outs, Communicator& host) = 0;
  // After the iteration's last bucket.
  virtual void end_reductions() {}

  // Once reduce(b) returned: whether bucket b's result is complete where it
  // is read (on a device: executed, not only enqueued).
  virtual bool reduced(size_t b) const { return true; }
  // Makes `stream` wait for bucket b's result, or for the whole iteration's
  // (on the device; nothing to do on the host, where reduce() is synchronous).
  virtual void block_until_reduced(size_t b, void* stream) const {}
  virtual void block_until_done(void* stream) const {}
  // Blocks the host until every reduction and unpack enqueued so far on this
  // storage is complete on the device. Work that is not within `timeout` (a
  // collective whose peer is gone) is cut off by aborting the device
  // communicator, and waited for again.
  virtual void drain_device(std::chrono::milliseconds timeout) {}

 protected:
  std::vector<unsigned char*> buffers_;  // per bucket
};

class WireCodec;

// Host memory: reduced by the host communicator, results scaled by `scale`;
// buckets `codec` applies to travel compressed (it averages them itself).
std::unique_ptr<BucketStorage> make_host_buckets(const BucketLayout& layout, double scale,
                                                 WireCodec* codec = nullptr);

// How device buckets travel: `half` float16 or bfloat16 sends each float32
// bucket in that type (DDP's fp16/bf16 hooks: each rank divides by
// `world_size`, the wire sums); float32 sends every bucket as it is.
struct DeviceWire {
  DType half = DType::kFloat32;
  int world_size = 1;
};

// Device memory on CUDA device `device`, reduced on the engine's stream of
// that device by its device communicator. `timeout`: how long the host waits
// for earlier device work before declaring a rank dead.
std::unique_ptr<BucketStorage> make_device_buckets(const BucketLayout& layout, LaneHost& engine,
                                                   int device, bool average,
                                                   const DeviceWire& wire,
                                                   std::chrono::milliseconds timeout);

// Creates the engine's stream and communicator for CUDA device `device`, on
// the scheduler thread (a collective, in submission order); returns once done.
void set_up_device(LaneHost& engine, int device);

}  // namespace hemiola
