// Buckets in host memory: copies are memcpy on the producer's thread, and a
// reduction is the host communicator's, synchronous on the scheduler thread.
#include <algorithm>
#include <cstring>

#include "engine/reducer/bucket_storage.h"
#include "core/dtype_math.h"
#include "engine/codec/wire_codec.h"

namespace hemiola {

namespace {

class HostBuckets final : public BucketStorage {
 public:
  HostBuckets(const BucketLayout& layout, double scale, WireCodec* codec)
      : layout_(layout), scale_(scale), codec_(codec), used_(layout.specs.size(), 1) {
    for (const auto& bucket : layout_.plan) {
      // Zero-filled: zero-element buckets and never-written slots read as zeros.
      storage_.emplace_back(new unsigned char[std::max<size_t>(bucket.nbytes(), 1)]());
      buffers_.push_back(storage_.back().get());
    }
  }

  void copy_in(size_t index, const void* source, bool used, void*) override {
    // Producers write distinct elements; the scheduler reads them after the
    // bucket's acq_rel pending count.
    used_[index] = used ? 1 : 0;
    const size_t elem = dtype_size(layout_.specs[index].dtype);
    for (const Placement& piece : layout_.placement[index]) {
      unsigned char* dst = buffers_[piece.bucket] + piece.offset * elem;
      if (used) {
        std::memcpy(dst, static_cast<const unsigned char*>(source) + piece.begin * elem,
                    piece.count * elem);
      } else {
        std::memset(dst, 0, piece.count * elem);
      }
    }
  }

  void begin_reductions(uint64_t iteration, const BucketStorage*) override {
    iteration_ = iteration;
  }

  void reduce(size_t b, const std::vector<void*>& outs, Communicator& host) override {
    const PlannedBucket& plan = layout_.plan[b];
    unsigned char* buffer = buffers_[b];
    const bool averaged_on_wire = codec_ != nullptr && codec_->applies(plan, iteration_);
    if (averaged_on_wire) {
      codec_->reduce_average(plan, buffer, host, iteration_, used_);
    } else {
      host.all_reduce_sum(TensorRef{buffer, plan.dtype, plan.numel, Device{}});
    }
    const bool scale = !averaged_on_wire && scale_ != 1.0;
    const size_t elem = dtype_size(plan.dtype);
    // Average and copy out a cache-sized chunk at a time: the copy reads
    // what the scaling just wrote while it is still in cache, instead of a
    // second pass over the whole bucket from memory.
    constexpr size_t kChunkBytes = 64 << 10;
    const size_t chunk = std::max<size_t>(1, kChunkBytes / elem);
    for (size_t k = 0; k < plan.tensors.size(); ++k) {
      unsigned char* in = buffer + plan.offsets[k] * elem;
      auto* out = static_cast<unsigned char*>(outs[plan.tensors[k]]);
      if (out != nullptr) out += plan.begins[k] * elem;
      for (size_t done = 0; done < plan.counts[k]; done += chunk) {
        const size_t n = std::min(chunk, plan.counts[k] - done);
        if (scale) scale_in_place(plan.dtype, in + done * elem, n, scale_);
        if (out != nullptr) std::memcpy(out + done * elem, in + done * elem, n * elem);
      }
    }
  }

 private:
  const BucketLayout layout_;
  const double scale_;
  WireCodec* const codec_;  // the reducer's, shared by its flights; null: none
  uint64_t iteration_ = 0;  // the iteration being reduced (scheduler thread)
  std::vector<uint8_t> used_;  // per tensor, this iteration: produced on this rank
  std::vector<std::unique_ptr<unsigned char[]>> storage_;
};

}  // namespace

std::unique_ptr<BucketStorage> make_host_buckets(const BucketLayout& layout, double scale,
                                                 WireCodec* codec) {
  return std::make_unique<HostBuckets>(layout, scale, codec);
}

}  // namespace hemiola
