// kInt8: one byte per float32 element of a host bucket, with error feedback.
// Each rank adds to its gradient what its coding dropped last time (its
// residual), and codes the sum v as q = rint(v / s) with one scale s per
// block of kInt8Block elements: s = max over ranks of the block's max |v|,
// divided by L = floor(127 / world), so the codes of all ranks sum within an
// int8 and a uint8 all-reduce (wrap-around, exact modulo 256) adds them
// exactly. The scales are agreed by an all-gather of each rank's block
// maxima (4 bytes per block, 1.6% of float32's bytes). The average is
// s * sum(q) / world; the residual becomes v - s * q.
//
// Every rank decodes the same sums with the same scales, so the averages are
// bitwise identical across ranks. A non-finite value makes its block's scale
// non-finite: the whole block's average is NaN on every rank (as an
// uncompressed all-reduce would carry it), and that block's residual is reset.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/codec/codings.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

class Int8Host final : public BlockCodedHost {
 public:
  explicit Int8Host(const CodecSpec& spec) : BlockCodedHost(Compression::kInt8, spec) {
    HEMIOLA_CHECK(world_ <= 127, "compression int8 sums every rank's one-byte codes in one "
                  "byte, which needs at most 127 ranks (world_size is ", world_, ")");
  }

 protected:
  void reduce(const PlannedBucket& plan, float* data, Communicator& comm,
              const std::vector<uint8_t>& used) override;
};

void Int8Host::reduce(const PlannedBucket& plan, float* data, Communicator& comm,
                      const std::vector<uint8_t>& used) {
  const size_t n = plan.numel;
  const size_t blocks = (n + kInt8Block - 1) / kInt8Block;
  const int levels = 127 / world_;
  // Pass 1: v = gradient + residual, in the bucket itself; then each block's
  // scale, the same on every rank.
  add_residuals(plan, data, residuals_, used);
  agree_block_maxima(data, n, comm, world_, maxima_, gathered_);
  for (size_t blk = 0; blk < blocks; ++blk) {
    maxima_[blk] /= static_cast<float>(levels);  // now the block's scale
  }
  // Pass 2: code, keeping what the coding drops in v (the new residual).
  codes_.resize(n);
  const float magic = 12582912.0f;  // 1.5 * 2^23: (x + magic) - magic == rint(x) for small x
  const float limit = static_cast<float>(levels);
  for (size_t blk = 0; blk < blocks; ++blk) {
    const size_t first = blk * kInt8Block;
    const size_t end = std::min(n, first + kInt8Block);
    const float s = maxima_[blk];
    int8_t* codes = reinterpret_cast<int8_t*>(codes_.data());
    const float inverse = 1.0f / s;
    // A scale so small that its inverse overflows (a block of values below
    // about 1e-37) is not coded either: the residual keeps those values.
    if (std::isfinite(s) && s > 0.0f && std::isfinite(inverse)) {
      for (size_t i = first; i < end; ++i) {
        const float x = std::min(limit, std::max(-limit, data[i] * inverse));
        const float q = (x + magic) - magic;
        codes[i] = static_cast<int8_t>(q);
        data[i] -= s * q;
      }
    } else {
      // Zero or tiny scale: code 0, and v stays in the residual (zeros for a
      // zero block). NaN: the block's average is NaN for everyone; its
      // residual is dropped.
      const bool drop = std::isnan(s);
      for (size_t i = first; i < end; ++i) {
        codes[i] = 0;
        if (drop) data[i] = 0.0f;
      }
    }
  }
  keep_residuals(plan, data, residuals_, used);
  comm.all_reduce_sum(TensorRef{codes_.data(), DType::kUInt8, n, Device{}});
  // Pass 3: the average. A zero scale decodes to zeros, a NaN scale to NaN.
  for (size_t blk = 0; blk < blocks; ++blk) {
    const size_t first = blk * kInt8Block;
    const size_t end = std::min(n, first + kInt8Block);
    const float step = maxima_[blk] / static_cast<float>(world_);
    const int8_t* sums = reinterpret_cast<const int8_t*>(codes_.data());
    for (size_t i = first; i < end; ++i) data[i] = step * static_cast<float>(sums[i]);
  }
}

}  // namespace

std::unique_ptr<Codec> make_int8_codec(const CodecSpec& spec) {
  return std::make_unique<Int8Host>(spec);
}

}  // namespace hemiola
