// The codings behind the factory (factory.cpp): one constructor per coding
// and device, and the plain send every coding falls back to for a bucket it
// does not apply to. Only the codec's own files include this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/codec/codec.h"

namespace hemiola {

// Elements that share one int8 (or int4) scale. Even, so the two 4-bit
// codes of one int4 byte always belong to the same block.
constexpr size_t kInt8Block = 256;

// Whether a coding can compress bucket `plan` at all: float32 buckets only,
// others travel as they are.
inline bool compressible(const PlannedBucket& plan) {
  return plan.dtype == DType::kFloat32 && plan.numel > 0;
}

// What an uncompressed host bucket's sum is scaled by: 1/world when averaging.
inline double plain_scale(const CodecSpec& spec) {
  return spec.average ? 1.0 / spec.world_size : 1.0;
}

// An uncompressed bucket on the host: summed by the host communicator; the
// result is still to be scaled by 1/world when averaging (returned).
double send_plain_host(BucketStorage& storage, size_t b, Communicator& host, double scale);
// An uncompressed bucket on device `here`: all-reduced (averaged if
// `average`) by the storage's device communicator on its stream.
double send_plain_device(BucketStorage& storage, size_t b, const Device& here, bool average);

// Scratch of the block-scaled codings, reused by every bucket
// (block_coding.h): the records sent, received, owned and gathered, and the
// owned chunk's average.
struct BlockScratch {
  std::vector<uint8_t> send, received, mine, gathered;
  std::vector<float> average;
};

// The block-scaled codings with error feedback (int8, int4; blocks.cpp):
// what they share. A float32 host bucket is coded with this rank's residuals
// and averaged by the coding's reduce() (block_coding.h); any other bucket
// travels plain.
class BlockCodedHost : public Codec {
 public:
  // Per tensor, 2 x its elements: what this rank's coding dropped, then what
  // the second coding dropped of the elements this rank owns (block_coding.h).
  std::vector<float>* residual(size_t index) override { return &residuals_[index]; }

 protected:
  BlockCodedHost(Compression compression, const CodecSpec& spec);

  double send(BucketStorage& storage, size_t b, uint64_t iteration,
              Communicator& comm) override;
  // All-reduces the float32 bucket at `data` (laid out as `plan`) in place
  // and leaves the average there. `used[t]`: whether this rank produced
  // tensor t's gradient this iteration (an unused one contributes zeros and
  // keeps its residual).
  virtual void reduce(const PlannedBucket& plan, float* data, Communicator& comm,
                      const std::vector<uint8_t>& used) = 0;

  std::vector<std::vector<float>> residuals_;  // per tensor
  BlockScratch scratch_;

 private:
  const double scale_;  // an uncompressed bucket's: 1/world when averaging
};

// v = gradient + residual, in the bucket `data` (laid out as `plan`): a
// tensor this rank did not use (`used[t]` 0) contributes zeros and keeps its
// residual for later. Reads the first half of each residual vector.
void add_residuals(const PlannedBucket& plan, float* data,
                   const std::vector<std::vector<float>>& residuals,
                   const std::vector<uint8_t>& used);
// The residuals (first halves) of the used tensors become what `data` holds now.
void keep_residuals(const PlannedBucket& plan, const float* data,
                    std::vector<std::vector<float>>& residuals,
                    const std::vector<uint8_t>& used);

std::unique_ptr<Codec> make_none_codec(const CodecSpec& spec);
std::unique_ptr<Codec> make_half_codec(const CodecSpec& spec);  // host or CUDA
std::unique_ptr<Codec> make_int8_codec(const CodecSpec& spec);  // host
std::unique_ptr<Codec> make_int4_codec(const CodecSpec& spec);  // host
std::unique_ptr<Codec> make_powersgd_codec(const CodecSpec& spec);  // host

}  // namespace hemiola
