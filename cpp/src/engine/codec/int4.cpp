// kInt4: half a byte per float32 element of a host bucket, with error
// feedback: int8.cpp's coding with 4-bit codes, two to a byte.
//
// As in int8, each rank codes v = gradient + residual as q = rint(v / s),
// with one scale per block of kInt8Block elements agreed by an all-gather of
// the block maxima: s = max over ranks of the block's max |v| / L, so
// q is in [-L, L]. Code q travels as the nibble q + L (element 2i in the low
// nibble of byte i, element 2i + 1 in the high one), and a uint8 all-reduce
// adds the bytes.
//
// Invariant: L = floor(15 / (2 * world)), so every rank's nibble is in
// [0, 2L] and the sum of the world's nibbles is at most world * 2L <= 15.
// Every partial sum is non-negative and at most the final one, so a low
// nibble's sum never carries into the high nibble and a byte's sum (at most
// 15 + 16 * 15 = 255) never wraps, in whatever order the collective adds:
// the summed byte is exactly low_sum + 16 * high_sum, and sum(q) = nibble
// sum - world * L. L is 7 for one rank, 3 at 2 ranks (7 levels), 2 at 3, 1
// at 4-7 (three levels: -s, 0, s); at 8 ranks it would be 0, so more than 7
// ranks are refused (int8 takes up to 127).
//
// The average is s * sum(q) / world; the residual becomes v - s * q. Every
// rank decodes the same sums with the same scales: the averages are bitwise
// identical across ranks. A non-finite value makes its block's scale NaN:
// the block's average is NaN on every rank and its residual is reset (its
// nibbles still travel as q = 0, so the invariant holds for its bytes).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/codec/codings.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

class Int4Host final : public BlockCodedHost {
 public:
  explicit Int4Host(const CodecSpec& spec) : BlockCodedHost(Compression::kInt4, spec) {
    HEMIOLA_CHECK(world_ <= 7, "compression int4 sums every rank's 4-bit codes in four bits, "
                  "which leaves a level either side of zero for at most 7 ranks (world_size "
                  "is ", world_, "): use compression int8 (up to 127 ranks)");
  }

 protected:
  void reduce(const PlannedBucket& plan, float* data, Communicator& comm,
              const std::vector<uint8_t>& used) override;
};

void Int4Host::reduce(const PlannedBucket& plan, float* data, Communicator& comm,
                      const std::vector<uint8_t>& used) {
  const size_t n = plan.numel;
  const size_t blocks = (n + kInt8Block - 1) / kInt8Block;
  const int levels = 15 / (2 * world_);  // L
  // Pass 1: v = gradient + residual, in the bucket itself; then each block's
  // scale, the same on every rank.
  add_residuals(plan, data, residuals_, used);
  agree_block_maxima(data, n, comm, world_, maxima_, gathered_);
  for (size_t blk = 0; blk < blocks; ++blk) {
    maxima_[blk] /= static_cast<float>(levels);  // now the block's scale
  }
  // Pass 2: code, keeping what the coding drops in v (the new residual). The
  // high nibble of an odd bucket's last byte stays 0 on every rank.
  codes_.assign((n + 1) / 2, 0);
  const float magic = 12582912.0f;  // 1.5 * 2^23: (x + magic) - magic == rint(x) for small x
  const float limit = static_cast<float>(levels);
  const uint8_t zero = static_cast<uint8_t>(levels);  // the nibble of q = 0
  for (size_t blk = 0; blk < blocks; ++blk) {
    const size_t first = blk * kInt8Block;
    const size_t end = std::min(n, first + kInt8Block);
    const float s = maxima_[blk];
    const float inverse = 1.0f / s;
    // A scale so small that its inverse overflows (a block of values below
    // about 1e-37) is not coded either: the residual keeps those values.
    if (std::isfinite(s) && s > 0.0f && std::isfinite(inverse)) {
      for (size_t i = first; i < end; ++i) {
        const float x = std::min(limit, std::max(-limit, data[i] * inverse));
        const float q = (x + magic) - magic;
        const uint8_t nibble = static_cast<uint8_t>(static_cast<int>(q) + levels);
        codes_[i / 2] |= static_cast<uint8_t>(nibble << (4 * (i & 1)));
        data[i] -= s * q;
      }
    } else {
      // Zero or tiny scale: code 0, and v stays in the residual (zeros for a
      // zero block). NaN: the block's average is NaN for everyone; its
      // residual is dropped.
      const bool drop = std::isnan(s);
      for (size_t i = first; i < end; ++i) {
        codes_[i / 2] |= static_cast<uint8_t>(zero << (4 * (i & 1)));
        if (drop) data[i] = 0.0f;
      }
    }
  }
  keep_residuals(plan, data, residuals_, used);
  comm.all_reduce_sum(TensorRef{codes_.data(), DType::kUInt8, codes_.size(), Device{}});
  // Pass 3: the average. A zero scale decodes to zeros, a NaN scale to NaN.
  const int offset = world_ * levels;  // sum(q) = nibble sum - world * L
  for (size_t blk = 0; blk < blocks; ++blk) {
    const size_t first = blk * kInt8Block;
    const size_t end = std::min(n, first + kInt8Block);
    const float step = maxima_[blk] / static_cast<float>(world_);
    for (size_t i = first; i < end; ++i) {
      const int sum = (codes_[i / 2] >> (4 * (i & 1))) & 0xF;
      data[i] = step * static_cast<float>(sum - offset);
    }
  }
}

}  // namespace

std::unique_ptr<Codec> make_int4_codec(const CodecSpec& spec) {
  return std::make_unique<Int4Host>(spec);
}

}  // namespace hemiola
