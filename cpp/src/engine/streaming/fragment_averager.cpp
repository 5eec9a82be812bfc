// The fragment averager: one fragment's average per unit of work on the
// "outer" wire, and in a replica group the gather of its pieces on the
// group's "outer-gather" wire.
#include "engine/streaming/fragment_averager.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "hemiola/status.h"

namespace hemiola {

namespace {

// "none, fp16, bf16, int8 or int4": the codings streaming may send with.
std::string streaming_codings() {
  return listed(coding_names([](const Coding& c) { return c.streams; }), "or");
}

size_t largest_bytes(const std::vector<PlannedBucket>& plan) {
  size_t out = 1;
  for (const auto& bucket : plan) out = std::max(out, bucket.nbytes());
  return out;
}

}  // namespace

PlannedBucket slice_bucket(const PlannedBucket& bucket, size_t begin, size_t count) {
  HEMIOLA_CHECK(begin + count <= bucket.numel, "slice_bucket: [", begin, ", ", begin + count,
                ") is outside a bucket of ", bucket.numel, " elements");
  PlannedBucket out;
  out.dtype = bucket.dtype;
  const size_t end = begin + count;
  for (size_t k = 0; k < bucket.tensors.size(); ++k) {
    // Entry k covers bucket elements [offsets[k], offsets[k] + counts[k]).
    const size_t lo = std::max(begin, bucket.offsets[k]);
    const size_t hi = std::min(end, bucket.offsets[k] + bucket.counts[k]);
    if (lo >= hi) continue;
    out.tensors.push_back(bucket.tensors[k]);
    out.begins.push_back(bucket.begins[k] + (lo - bucket.offsets[k]));
    out.counts.push_back(hi - lo);
    out.offsets.push_back(lo - begin);
  }
  out.numel = count;
  return out;
}

class FragmentAverager::Average final : public Work {
 public:
  Average(FragmentAverager& averager, size_t fragment, uint64_t round)
      : averager_(averager), fragment_(fragment), round_(round) {}

  void run(Communicator& comm, Timeline& timeline) override {
    averager_.averaged_.store(false);
    // An empty piece (a fragment of fewer elements than the group has
    // ranks) is empty on every rank that shares it: nothing to send.
    if (averager_.storage_->layout().plan[fragment_].numel == 0) return;
    const int64_t start_us = timeline.now_us();
    averager_.codec_->reduce(*averager_.storage_, fragment_, round_, averager_.outs_, comm);
    averager_.averaged_.store(true);
    if (averager_.confirm_) averager_.confirm(comm);
    if (timeline.enabled()) {
      timeline.record("outer", describe(), "outer", start_us, timeline.now_us());
    }
  }
  std::string describe() const override {
    return "outer average of fragment " + std::to_string(fragment_) + " (sync " +
           std::to_string(round_) + ")";
  }

 private:
  FragmentAverager& averager_;
  const size_t fragment_;
  const uint64_t round_;
};

// Waits for this rank's piece of the fragment to be averaged across groups,
// then all-gathers the group's pieces: the whole fragment's average.
//
// Elastic (confirm): the group's wire must outlive a failure between groups
// (the group stays; only the membership across changes), so a piece whose
// average failed is gathered all the same (zeros), beside one status row
// per rank: confirmed, has its piece's average, and the offer it agreed.
// Every rank of the group then holds the same verdict: the fragment's
// average stands only if every piece was confirmed, it can be kept only if
// every piece was averaged, and the agreed offer is the largest.
class FragmentAverager::Gather final : public Work {
 public:
  Gather(FragmentAverager& averager, size_t fragment, Handle piece)
      : averager_(averager), fragment_(fragment), piece_(std::move(piece)) {}

  void run(Communicator& comm, Timeline& timeline) override {
    std::string failure;
    try {
      piece_.wait();  // rethrows the average's failure (a replica that died)
    } catch (const std::exception& e) {
      if (!averager_.confirm_) throw;
      failure = e.what();
    }
    const int64_t start_us = timeline.now_us();
    const PlannedBucket& piece = averager_.pieces_[fragment_];
    const size_t padded = averager_.piece_numel(fragment_);
    const size_t elem = dtype_size(piece.dtype);
    const size_t valid = failure.empty() ? piece.nbytes() : 0;
    std::memcpy(averager_.piece_out_.get(), averager_.storage_->buffer(fragment_), valid);
    std::memset(averager_.piece_out_.get() + valid, 0, padded * elem - valid);
    const size_t ranks = static_cast<size_t>(averager_.group_->options().world_size);
    comm.all_gather(TensorRef{averager_.piece_out_.get(), piece.dtype, padded, Device{}},
                    TensorRef{averager_.gathered_.get(), piece.dtype, padded * ranks, Device{}});
    if (averager_.confirm_) agree(comm, failure, ranks);
    if (timeline.enabled()) {
      timeline.record("outer-gather", describe(), "outer", start_us, timeline.now_us());
    }
  }
  std::string describe() const override {
    return "gather of fragment " + std::to_string(fragment_) + "'s averaged pieces in the group";
  }

 private:
  void agree(Communicator& comm, const std::string& failure, size_t ranks) {
    double mine[3] = {failure.empty() ? 1.0 : 0.0, averager_.averaged_.load() ? 1.0 : 0.0,
                      static_cast<double>(averager_.agreed_.load())};
    std::vector<double> all(3 * ranks, 0.0);
    comm.all_gather(TensorRef{mine, DType::kFloat64, 3, Device{}},
                    TensorRef{all.data(), DType::kFloat64, 3 * ranks, Device{}});
    bool confirmed = true, averaged = true;
    double agreed = 0.0;
    size_t first_failed = ranks;
    for (size_t r = 0; r < ranks; ++r) {
      if (all[3 * r] == 0.0 && first_failed == ranks) first_failed = r;
      confirmed = confirmed && all[3 * r] != 0.0;
      averaged = averaged && all[3 * r + 1] != 0.0;
      agreed = std::max(agreed, all[3 * r + 2]);
    }
    averager_.averaged_.store(averaged);
    averager_.agreed_.store(static_cast<uint64_t>(agreed));
    averager_.group_failure_ =
        confirmed ? std::string()
                  : !failure.empty() ? failure
                                     : "the average of fragment " + std::to_string(fragment_) +
                                           "'s piece " + std::to_string(first_failed) +
                                           " failed on that rank of this group";
  }

  FragmentAverager& averager_;
  const size_t fragment_;
  const Handle piece_;
};

FragmentAverager::FragmentAverager(Scheduler& scheduler, const BucketLayout& fragments,
                                   Compression compression, Scheduler* group, bool confirm)
    : scheduler_(scheduler),
      fragments_(fragments.plan),
      group_(group),
      wire_(scheduler.connect_wire("outer")),
      outs_(fragments.specs.size(), nullptr),
      confirm_(confirm) {
  HEMIOLA_CHECK(coding(compression).streams, "streaming sends its pseudo-gradients with "
                "compression ", streaming_codings());
  if (grouped()) {
    group_wire_ = group_->connect_wire("outer-gather");
    const size_t ranks = static_cast<size_t>(group_->options().world_size);
    size_t largest_piece = 1;
    for (size_t f = 0; f < fragments_.size(); ++f) {
      const size_t each = piece_numel(f);
      const size_t begin = piece_begin(f);
      const size_t end = std::min(fragments_[f].numel, begin + each);
      pieces_.push_back(slice_bucket(fragments_[f], begin, end - begin));
      largest_piece = std::max(largest_piece, each * dtype_size(fragments_[f].dtype));
    }
    piece_placement_ = place_pieces(pieces_, fragments.specs.size());
    storage_ = make_host_buckets(BucketLayout{pieces_, piece_placement_, fragments.specs});
    staging_.reset(new unsigned char[largest_bytes(fragments_)]());
    piece_out_.reset(new unsigned char[largest_piece]());
    gathered_.reset(new unsigned char[largest_piece * ranks]());
  } else {
    storage_ = make_host_buckets(fragments);
  }
  codec_ = make_codec(CodecSpec{fragments.specs, Device{}, compression, /*average=*/true,
                                scheduler.options().world_size});
}

void FragmentAverager::confirm(Communicator& comm) {
  // One word per rank, exact in a double (epochs stay far below 2^53).
  const size_t ranks = static_cast<size_t>(comm.size());
  double mine = static_cast<double>(offered_.load());
  std::vector<double> all(ranks, 0.0);
  comm.all_gather(TensorRef{&mine, DType::kFloat64, 1, Device{}},
                  TensorRef{all.data(), DType::kFloat64, ranks, Device{}});
  agreed_.store(static_cast<uint64_t>(*std::max_element(all.begin(), all.end())));
}

size_t FragmentAverager::piece_numel(size_t f) const {
  const size_t ranks = static_cast<size_t>(group_->options().world_size);
  return (fragments_[f].numel + ranks - 1) / ranks;
}

size_t FragmentAverager::piece_begin(size_t f) const {
  return std::min(fragments_[f].numel,
                  static_cast<size_t>(group_->options().rank) * piece_numel(f));
}

unsigned char* FragmentAverager::sending(size_t f) const {
  HEMIOLA_CHECK(f < fragments_.size(), "fragment ", f, " is out of range");
  return grouped() ? staging_.get() : storage_->buffer(f);
}

Handle FragmentAverager::submit(size_t f, uint64_t round) {
  if (!grouped()) return scheduler_.submit(wire_, std::make_shared<Average>(*this, f, round));
  // This rank's piece of the filled fragment, into the bucket the coding
  // reduces (the piece's elements are contiguous in the fragment).
  std::memcpy(storage_->buffer(f),
              staging_.get() + piece_begin(f) * dtype_size(fragments_[f].dtype),
              pieces_[f].nbytes());
  Handle piece = scheduler_.submit(wire_, std::make_shared<Average>(*this, f, round));
  return group_->submit(group_wire_, std::make_shared<Gather>(*this, f, std::move(piece)));
}

const unsigned char* FragmentAverager::averaged(size_t f) const {
  HEMIOLA_CHECK(f < fragments_.size(), "fragment ", f, " is out of range");
  // The gathered pieces are the fragment's elements in order: piece j is
  // block j of P elements, and only the last blocks carry padding.
  return grouped() ? gathered_.get() : storage_->buffer(f);
}

std::vector<float>& FragmentAverager::residual(size_t index) {
  std::vector<float>* r = codec_->residual(index);
  HEMIOLA_CHECK(r != nullptr, "residual() needs compression ",
                listed(coding_names([](const Coding& c) { return c.streams && c.residuals; }),
                       "or"),
                " (error feedback)");
  return *r;
}

}  // namespace hemiola
