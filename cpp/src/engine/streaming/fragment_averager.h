// Streaming's outer synchronisation (hemiola/streamer.h): a fragment's
// pseudo-gradient averaged over the replicas on a wire of its own ("outer"),
// through the coding, while the inner steps go on. One fragment at a time,
// in the order they are sent, which is the same on every rank.
//
// The averager receives a bucket (the fragment's pseudo-gradient, in the
// fragment's plan layout) and hands one back (its average); its buffers are
// a host BucketStorage, so the codings are the reducer's. It needs nothing
// of the iteration ring: fragments are sent by the Streamer's step count,
// not by gradients becoming ready.
//
// Replica groups. When a replica is a group of L ranks that hold the same
// parameters (a per-step schedule keeps them equal), their pseudo-gradients
// are equal too, so no rank of a group needs to send a whole fragment: rank
// j of the group averages only piece j of it (elements [j*P, min((j+1)*P, n))
// of the fragment's n, P = ceil(n / L)) with the j-th ranks of the other
// groups (`scheduler`'s ranks), and the group all-gathers the averaged pieces
// on its own wire (`group`'s). A group so puts one fragment's bytes on the
// link between groups however many ranks it holds. The reduce-scatter inside
// the group that this would otherwise need is a plain slice: every rank of a
// group holds the whole pseudo-gradient already. Every rank ends with the
// same average, bitwise: the j-th ranks of all groups hold piece j's same
// result, and the all-gather copies it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
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
  // out in; it must outlive the averager. `scheduler`: the wire between
  // replicas. `group`: this rank's replica group (null: the rank is a
  // replica alone). Connects the wires (a rendezvous: at the same point on
  // every rank).
  // `confirm`: after each average, every rank says it has it and what it
  // was offered (offer()); an elastic run's commit point (below).
  FragmentAverager(Scheduler& scheduler, const BucketLayout& fragments, Compression compression,
                   Scheduler* group = nullptr, bool confirm = false);

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
  // fragment's plan (valid until the next average).
  const unsigned char* averaged(size_t f) const;
  // A streaming coding that keeps residuals (coding(c).residuals): tensor
  // `index`'s residual (read and write it only while nothing is in flight).
  // In a group, only this rank's pieces of it are ever non-zero.
  std::vector<float>& residual(size_t index);

  // ---- elastic membership (confirm) -------------------------------------
  // A confirmed average is one every rank has: after the average, the ranks
  // all-gather one word each (what they were offered), and a rank whose
  // confirmation completed knows every rank entered it, so every rank
  // completed the average. A rank whose confirmation failed does not know
  // whether the others have the average; averaged_before_failure() says
  // whether it has (the coordinator decides, from every survivor's answer,
  // whether the average is kept or done again: python/hemiola/elastic).
  //
  // What this rank offers in its next confirmations (a membership epoch the
  // coordinator announced; 0: none). Any thread.
  void offer(uint64_t epoch) { offered_.store(epoch); }
  // The largest offer of the last confirmed average (the same on every rank).
  uint64_t agreed() const { return agreed_.load(); }
  // Whether the last average completed on this rank (its confirmation may
  // still have failed); in a group, on every rank of the group.
  bool averaged_before_failure() const { return averaged_.load(); }
  // In a group: why the last average failed on some rank of the group ("":
  // it did not), once its handle is done. The group's wire carries on; the
  // caller raises this on every rank of the group alike.
  const std::string& group_failure() const { return group_failure_; }

 private:
  class Average;
  class Gather;

  bool grouped() const { return group_ != nullptr; }
  // The confirmation after an average (on the wire's thread).
  void confirm(Communicator& comm);
  // Elements per piece of fragment `f` (P), and where this rank's piece
  // starts in it (its rank in the group times P, at most the fragment's
  // size), in a group.
  size_t piece_numel(size_t f) const;
  size_t piece_begin(size_t f) const;
  unsigned char* sending(size_t f) const;
  Handle submit(size_t f, uint64_t round);

  Scheduler& scheduler_;
  const std::vector<PlannedBucket>& fragments_;
  Scheduler* const group_;
  const size_t wire_;
  // In a group: the group's wire, and this rank's piece of each fragment
  // (the plan the coding reduces; otherwise the fragments' own).
  size_t group_wire_ = 0;
  std::vector<PlannedBucket> pieces_;
  std::vector<std::vector<Placement>> piece_placement_;
  std::unique_ptr<BucketStorage> storage_;
  // In a group: the whole fragment's pseudo-gradient as filled, this rank's
  // averaged piece padded to P, and the group's pieces gathered (L * P).
  std::unique_ptr<unsigned char[]> staging_;
  std::unique_ptr<unsigned char[]> piece_out_;
  std::unique_ptr<unsigned char[]> gathered_;
  // Used on the wire's thread only, one fragment at a time in send order,
  // so a residual is written before it is read again.
  std::unique_ptr<Codec> codec_;
  const std::vector<void*> outs_;  // none: the average stays in the buffer
  const bool confirm_;
  std::atomic<uint64_t> offered_{0};
  std::atomic<uint64_t> agreed_{0};
  std::atomic<bool> averaged_{false};
  std::string group_failure_;  // written by the gather, read after its handle
};

// Piece [begin, begin + count) of `bucket`'s elements, as a bucket of its
// own (the tensors' pieces it covers, offsets from 0).
PlannedBucket slice_bucket(const PlannedBucket& bucket, size_t begin, size_t count);

}  // namespace hemiola
