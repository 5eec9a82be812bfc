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
#include <limits>
#include <vector>

#include "engine/codec/codings.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

class Int8Host final : public Codec {
 public:
  explicit Int8Host(const CodecSpec& spec)
      : Codec(Compression::kInt8), world_(spec.world_size), scale_(plain_scale(spec)) {
    HEMIOLA_CHECK(world_ <= 127, "compression int8 sums every rank's one-byte codes in one "
                  "byte, which needs at most 127 ranks (world_size is ", world_, ")");
    residuals_.resize(spec.specs.size());
    for (size_t i = 0; i < spec.specs.size(); ++i) {
      if (spec.specs[i].dtype == DType::kFloat32) residuals_[i].assign(spec.specs[i].numel, 0.0f);
    }
  }

  std::vector<float>* residual(size_t index) override { return &residuals_[index]; }

 protected:
  double send(BucketStorage& storage, size_t b, uint64_t, Communicator& comm) override {
    const PlannedBucket& plan = storage.layout().plan[b];
    if (!compressible(plan)) return send_plain_host(storage, b, comm, scale_);
    reduce(plan, reinterpret_cast<float*>(storage.buffer(b)), comm, storage.used());
    return 1.0;  // averaged on the wire
  }

 private:
  // All-reduces the float32 bucket at `data` (laid out as `plan`) in place and
  // leaves the average there. `used[t]`: whether this rank produced tensor
  // t's gradient this iteration (an unused one contributes zeros and keeps
  // its residual).
  void reduce(const PlannedBucket& plan, float* data, Communicator& comm,
              const std::vector<uint8_t>& used);

  const int world_;
  const double scale_;  // an uncompressed bucket's: 1/world when averaging
  std::vector<std::vector<float>> residuals_;  // per tensor
  // Scratch, reused by every bucket: the wire buffer and the block maxima.
  std::vector<uint8_t> codes_;
  std::vector<float> maxima_;
  std::vector<float> gathered_;
};

void Int8Host::reduce(const PlannedBucket& plan, float* data, Communicator& comm,
                      const std::vector<uint8_t>& used) {
  const size_t n = plan.numel;
  const size_t blocks = (n + kInt8Block - 1) / kInt8Block;
  const int levels = 127 / world_;
  // Pass 1: v = gradient + residual, in the bucket itself. A tensor this rank
  // did not use contributes zeros and keeps its residual for later.
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    if (!used[plan.tensors[k]]) continue;
    const float* residual = residuals_[plan.tensors[k]].data() + plan.begins[k];
    float* v = data + plan.offsets[k];
    const size_t count = plan.counts[k];
    for (size_t j = 0; j < count; ++j) v[j] += residual[j];
  }
  // Each block's max |v| on this rank (NaN when the block holds a non-finite
  // value: max() drops NaN, so a separate finiteness test), then the max over
  // the ranks: the same scales everywhere.
  maxima_.resize(blocks);
  for (size_t blk = 0; blk < blocks; ++blk) {
    const size_t first = blk * kInt8Block;
    const size_t end = std::min(n, first + kInt8Block);
    float m = 0.0f;
    float bad = 0.0f;  // stays 0 while every value is finite
    for (size_t i = first; i < end; ++i) {
      const float a = std::fabs(data[i]);
      m = std::max(m, a);
      bad += a - a;  // NaN for an infinite or NaN value
    }
    maxima_[blk] = bad == 0.0f ? m : std::numeric_limits<float>::quiet_NaN();
  }
  gathered_.resize(blocks * static_cast<size_t>(world_));
  comm.all_gather(TensorRef{maxima_.data(), DType::kFloat32, blocks, Device{}},
                  TensorRef{gathered_.data(), DType::kFloat32, gathered_.size(), Device{}});
  for (size_t blk = 0; blk < blocks; ++blk) {
    float m = 0.0f;
    for (int r = 0; r < world_; ++r) {
      const float x = gathered_[static_cast<size_t>(r) * blocks + blk];
      m = std::isnan(x) || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN()
                                         : std::max(m, x);
    }
    maxima_[blk] = m / static_cast<float>(levels);  // now the block's scale
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
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    if (!used[plan.tensors[k]]) continue;
    float* residual = residuals_[plan.tensors[k]].data() + plan.begins[k];
    const float* v = data + plan.offsets[k];
    std::copy(v, v + plan.counts[k], residual);
  }
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
