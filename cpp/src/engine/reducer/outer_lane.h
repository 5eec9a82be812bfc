// Streaming's outer synchronisation (hemiola/streamer.h): a fragment's
// pseudo-gradient averaged on a wire of its own ("outer"), through the
// coding, while the inner steps go on. One fragment at a time, in the order
// they are sent, which is the same on every rank.
//
// It needs nothing of the iteration ring: fragments are sent by the
// Streamer's step count, not by gradients becoming ready. Its buffers are a
// host BucketStorage over the fragments, so the codings are the reducer's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/buckets/bucket_storage.h"
#include "engine/codec/codec.h"
#include "engine/reducer/lane_host.h"
#include "hemiola/config.h"
#include "hemiola/handle.h"

namespace hemiola {

class OuterLane {
 public:
  // `fragments`: the parameters (specs) and the plan the fragments are laid
  // out in; it must outlive the lane. Connects the wire (a rendezvous: at
  // the same point on every rank).
  OuterLane(LaneHost& host, const BucketLayout& fragments, Compression compression);

  // Fragment `f`'s buffer: the caller writes its pseudo-gradient there.
  unsigned char* buffer(size_t f) const { return storage_->buffer(f); }
  // Averages fragment `f`'s buffer over the ranks in place (`round`: the
  // how-many-th sync, for the coding). The buffer must stay untouched until
  // the handle is done.
  Handle average(size_t f, uint64_t round);
  // Compression::kInt8 / kInt4: tensor `index`'s residual (read and write it only
  // while nothing is in flight).
  std::vector<float>& residual(size_t index);

 private:
  class Average;

  LaneHost& host_;
  const size_t wire_;
  std::unique_ptr<BucketStorage> storage_;
  // Used on the wire's thread only, one fragment at a time in send order,
  // so a residual is written before it is read again.
  std::unique_ptr<Codec> codec_;
  const std::vector<void*> outs_;  // none: the average stays in the buffer
};

}  // namespace hemiola
