// Buckets in host memory: copies are memcpy on the producer's thread, and a
// reduction is the host communicator's, synchronous on the scheduler thread.
#include <algorithm>
#include <cstring>

#include "core/dtype_math.h"
#include "engine/buckets/bucket_storage.h"

namespace hemiola {

namespace {

class HostBuckets final : public BucketStorage {
 public:
  explicit HostBuckets(const BucketLayout& layout) : BucketStorage(layout) {
    used_.assign(layout_.specs.size(), 1);
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

  void copy_out(size_t b, const std::vector<void*>& outs, double scale_by) override {
    const PlannedBucket& plan = layout_.plan[b];
    unsigned char* buffer = buffers_[b];
    const bool scale = scale_by != 1.0;
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
        if (scale) scale_in_place(plan.dtype, in + done * elem, n, scale_by);
        if (out != nullptr) std::memcpy(out + done * elem, in + done * elem, n * elem);
      }
    }
  }

 private:
  std::vector<std::unique_ptr<unsigned char[]>> storage_;
};

}  // namespace

std::unique_ptr<BucketStorage> make_host_buckets(const BucketLayout& layout) {
  return std::make_unique<HostBuckets>(layout);
}

}  // namespace hemiola
