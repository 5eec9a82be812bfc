// Wire compression of a host bucket's all-reduce (ReducerOptions::compression).
//
// What travels, per float32 element of a bucket (other dtypes travel as they
// are):
//   - kFp16 / kBf16: two bytes. Each rank casts its bucket to the half type
//     and divides by the world size there (so the sum cannot overflow where
//     the gradients themselves did not), the halves are summed, and the sum
//     is cast back: what torch DDP's fp16_compress_hook and
//     bf16_compress_hook do, rounding for rounding.
//   - kInt8: one byte, with error feedback. Each rank adds to its gradient
//     what its coding dropped last time (its residual), and codes the sum v
//     as q = rint(v / s) with one scale s per block of kInt8Block elements:
//     s = max over ranks of the block's max |v|, divided by
//     L = floor(127 / world), so the codes of all ranks sum within an int8
//     and a uint8 all-reduce (wrap-around, exact modulo 256) adds them
//     exactly. The scales are agreed by an all-gather of each rank's block
//     maxima (4 bytes per block, 1.6% of float32's bytes). The average is
//     s * sum(q) / world; the residual becomes v - s * q.
//   - kPowerSgd: low rank with error feedback (engine/powersgd.h), from
//     iteration `powersgd_start_iteration` on; uncompressed before.
// Every rank decodes the same sums with the same scales, so the averages are
// bitwise identical across ranks. A non-finite value makes its block's scale
// non-finite: the whole block's average is NaN on every rank (as an
// uncompressed all-reduce would carry it), and that block's residual is reset.
//
// Threads: reduce() runs on the engine's scheduler thread only, one bucket at
// a time, in iteration order (so iteration t's residual is written before
// t+1 reads it). residual() is read between iterations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <memory>

#include "comm/communicator.h"
#include "engine/buckets/bucket_plan.h"
#include "engine/codec/powersgd.h"
#include "hemiola/config.h"

namespace hemiola {

// Elements that share one int8 scale.
constexpr size_t kInt8Block = 256;

class WireCodec {
 public:
  // `specs`: the reducer's gradients (residuals are kept per tensor, so they
  // survive a rebuild of the bucket plan).
  WireCodec(const ReducerOptions& options, const std::vector<GradSpec>& specs, int world);

  Compression compression() const { return compression_; }
  // Whether bucket `plan` travels compressed in iteration `iteration`
  // (float32 buckets only, and not during PowerSGD's warm-up: then it is
  // reduced as an uncompressed bucket is).
  bool applies(const PlannedBucket& plan, uint64_t iteration) const;
  // All-reduces the bucket at `buffer` (laid out as `plan`) of iteration
  // `iteration` in place and leaves the *average* there. Only for buckets
  // that applies() to. `used[t]`: whether this rank produced tensor t's
  // gradient this iteration (an unused one contributes zeros and keeps its
  // residual).
  void reduce_average(const PlannedBucket& plan, unsigned char* buffer, Communicator& comm,
                      uint64_t iteration, const std::vector<uint8_t>& used);
  // kInt8 and kPowerSgd: tensor `index`'s residual (float32, one per
  // element); empty for the other codings and for tensors never compressed.
  std::vector<float>& residual(size_t index) {
    return powersgd_ ? powersgd_->residual(index) : residuals_[index];
  }

 private:
  void reduce_half(const PlannedBucket& plan, float* data, Communicator& comm);
  void reduce_int8(const PlannedBucket& plan, float* data, Communicator& comm,
                   const std::vector<uint8_t>& used);

  const Compression compression_;
  const int world_;
  const uint64_t powersgd_start_;
  std::unique_ptr<PowerSgd> powersgd_;  // kPowerSgd
  std::vector<std::vector<float>> residuals_;  // per tensor (kInt8)
  // Scratch, reused by every bucket: the wire buffer and the block maxima.
  std::vector<uint16_t> halves_;
  std::vector<uint8_t> codes_;
  std::vector<float> maxima_;
  std::vector<float> gathered_;
};

}  // namespace hemiola
