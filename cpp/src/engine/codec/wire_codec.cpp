#include "engine/codec/wire_codec.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/half_cast.h"
#include "hemiola/status.h"

namespace hemiola {

WireCodec::WireCodec(const ReducerOptions& options, const std::vector<GradSpec>& specs,
                     int world)
    : compression_(options.compression),
      world_(world),
      powersgd_start_(options.powersgd_start_iteration) {
  HEMIOLA_CHECK(world >= 1, "world size must be positive, got ", world);
  if (compression_ == Compression::kInt8) {
    HEMIOLA_CHECK(world <= 127, "compression int8 sums every rank's one-byte codes in one byte, "
                  "which needs at most 127 ranks (world_size is ", world, ")");
    residuals_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].dtype == DType::kFloat32) residuals_[i].assign(specs[i].numel, 0.0f);
    }
  }
  if (compression_ == Compression::kPowerSgd) {
    powersgd_ = std::make_unique<PowerSgd>(specs, options.powersgd_rank, world);
  }
}

bool WireCodec::applies(const PlannedBucket& plan, uint64_t iteration) const {
  // PowerSGD's warm-up iterations travel as an uncompressed bucket does.
  const bool warming_up = compression_ == Compression::kPowerSgd && iteration < powersgd_start_;
  return compression_ != Compression::kNone && !warming_up && plan.dtype == DType::kFloat32 &&
         plan.numel > 0;
}

void WireCodec::reduce_average(const PlannedBucket& plan, unsigned char* buffer,
                               Communicator& comm, uint64_t iteration,
                               const std::vector<uint8_t>& used) {
  HEMIOLA_CHECK(applies(plan, iteration), "internal: bucket does not travel compressed");
  float* data = reinterpret_cast<float*>(buffer);
  if (compression_ == Compression::kPowerSgd) {
    powersgd_->reduce_average(plan, data, comm, used);
  } else if (compression_ == Compression::kInt8) {
    reduce_int8(plan, data, comm, used);
  } else {
    reduce_half(plan, data, comm);
  }
}

void WireCodec::reduce_half(const PlannedBucket& plan, float* data, Communicator& comm) {
  const DType half = compression_ == Compression::kFp16 ? DType::kFloat16 : DType::kBFloat16;
  const size_t n = plan.numel;
  halves_.resize(n);
  // Cast, then divide in the half type (the division rounds to it again),
  // as torch's hooks do: buffer.to(half).div_(world_size).
  floats_to_halves(half, data, halves_.data(), n, static_cast<float>(world_));
  comm.all_reduce_sum(TensorRef{halves_.data(), half, n, Device{}});
  halves_to_floats(half, halves_.data(), data, n);
}

void WireCodec::reduce_int8(const PlannedBucket& plan, float* data, Communicator& comm,
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

}  // namespace hemiola
