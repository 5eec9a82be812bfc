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

// The block-scaled codings with error feedback (int8, int4; blocks.cpp):
// what they share. A float32 host bucket is coded with this rank's residuals
// and averaged by the coding's reduce(); any other bucket travels plain.
class BlockCodedHost : public Codec {
 public:
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

  const int world_;
  std::vector<std::vector<float>> residuals_;  // per tensor
  // Scratch, reused by every bucket: the wire buffer and the block maxima.
  std::vector<uint8_t> codes_;
  std::vector<float> maxima_;
  std::vector<float> gathered_;

 private:
  const double scale_;  // an uncompressed bucket's: 1/world when averaging
};

// v = gradient + residual, in the bucket `data` (laid out as `plan`): a
// tensor this rank did not use (`used[t]` 0) contributes zeros and keeps its
// residual for later.
void add_residuals(const PlannedBucket& plan, float* data,
                   const std::vector<std::vector<float>>& residuals,
                   const std::vector<uint8_t>& used);
// The residuals of the used tensors become what `data` holds now.
void keep_residuals(const PlannedBucket& plan, const float* data,
                    std::vector<std::vector<float>>& residuals,
                    const std::vector<uint8_t>& used);
// maxima[blk]: the max over all ranks of block blk's max |v| (kInt8Block
// elements per block), NaN where any rank's block holds a non-finite value;
// the same on every rank (agreed by an all-gather of 4 bytes per block).
// `gathered`: scratch.
void agree_block_maxima(const float* data, size_t n, Communicator& comm, int world,
                        std::vector<float>& maxima, std::vector<float>& gathered);

std::unique_ptr<Codec> make_none_codec(const CodecSpec& spec);
std::unique_ptr<Codec> make_half_codec(const CodecSpec& spec);  // host or CUDA
std::unique_ptr<Codec> make_int8_codec(const CodecSpec& spec);  // host
std::unique_ptr<Codec> make_int4_codec(const CodecSpec& spec);  // host
std::unique_ptr<Codec> make_powersgd_codec(const CodecSpec& spec);  // host

}  // namespace hemiola
