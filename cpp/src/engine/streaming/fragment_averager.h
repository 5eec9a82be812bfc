// Streaming's outer synchronisation (hemiola/streamer.h): a fragment's
// pseudo-gradient averaged over the ranks on a wire of its own ("outer"),
// through the coding, while the inner steps go on. One fragment at a time,
// in the order they are sent, which is the same on every rank.
//
// The averager receives a bucket (the fragment's pseudo-gradient, in the
// fragment's plan layout) and hands one back (its average); its buffers are
// a host BucketStorage over the fragments, so the codings are the reducer's.
// It needs nothing of the iteration ring: fragments are sent by the
// Streamer's step count, not by gradients becoming ready.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/buckets/bucket_storage.h"
#include "engine/codec/codec.h"
#include "engine/wire/scheduler.h"
#include "hemiola/config.h"
#include "hemiola/handle.h"

namespace hemiola {

class FragmentAverager {
 public:
  // `fragments`: the parameters (specs) and the plan the fragments are laid
  // out in; it must outlive the averager. Connects the wire (a rendezvous:
  // at the same point on every rank).
  FragmentAverager(Scheduler& scheduler, const BucketLayout& fragments, Compression compression);

  // Starts averaging fragment `f`'s pseudo-gradient (`round`: the
  // how-many-th sync, for the coding): `fill` writes it, laid out as the
  // fragment's plan, into the memory it is given, before this returns.
  // At most one average is in flight; the previous one's handle must be done.
  template <typename Fill>
  Handle average(size_t f, uint64_t round, Fill&& fill) {
    fill(sending(f));
    return submit(f, round);
  }
  // Once average(f)'s handle is done: the average, laid out as the
  // fragment's plan (valid until the next average of `f`).
  const unsigned char* averaged(size_t f) const;
  // A streaming coding that keeps residuals (coding(c).residuals): tensor
  // `index`'s residual (read and write it only while nothing is in flight).
  std::vector<float>& residual(size_t index);

 private:
  class Average;

  unsigned char* sending(size_t f) const;
  Handle submit(size_t f, uint64_t round);

  Scheduler& scheduler_;
  const size_t wire_;
  std::unique_ptr<BucketStorage> storage_;
  // Used on the wire's thread only, one fragment at a time in send order,
  // so a residual is written before it is read again.
  std::unique_ptr<Codec> codec_;
  const std::vector<void*> outs_;  // none: the average stays in the buffer
};

}  // namespace hemiola
