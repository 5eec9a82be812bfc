// Streaming's outer synchronisation (hemiola/streamer.h): a fragment's
// pseudo-gradient averaged on a wire of its own ("outer"), through the
// wire's coding, while the inner steps go on. One fragment at a time, in the
// order they are sent, which is the same on every rank.
//
// It needs nothing of the iteration ring: fragments are sent by the
// Streamer's step count, not by gradients becoming ready.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/buckets/bucket_plan.h"
#include "engine/codec/wire_codec.h"
#include "engine/reducer/lane_host.h"
#include "hemiola/config.h"
#include "hemiola/handle.h"

namespace hemiola {

class OuterLane {
 public:
  // `specs`: the parameters (the coding keeps its residuals per tensor);
  // `fragments`: the plan the buffers are laid out in. Connects the wire (a
  // rendezvous: at the same point on every rank).
  OuterLane(LaneHost& host, const std::vector<GradSpec>& specs,
            const std::vector<PlannedBucket>& fragments, Compression compression);

  // Averages fragment `f`'s buffer over the ranks in place (`round`: the
  // how-many-th sync of the wire, for the coding). `buffer` must stay alive,
  // and untouched, until the handle is done.
  Handle average(size_t f, unsigned char* buffer, uint64_t round);
  // Compression::kInt8: tensor `index`'s residual (read and write it only
  // while nothing is in flight).
  std::vector<float>& residual(size_t index);
  Compression compression() const { return compression_; }

 private:
  class Average;

  LaneHost& host_;
  const std::vector<PlannedBucket>& fragments_;
  const Compression compression_;
  const size_t wire_;
  // The coding (null: none). Used on the wire's thread only, one fragment at
  // a time in send order, so a residual is written before it is read again.
  std::unique_ptr<WireCodec> codec_;
  const std::vector<uint8_t> used_;  // every parameter contributes to every sync
};

}  // namespace hemiola
