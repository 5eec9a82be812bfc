// PowerSGD (Vogels et al., NeurIPS 2019) for a host bucket, as torch's
// powerSGD_hook does it, with error feedback and warm start:
//
//   each compressible matrix M (a gradient viewed as rows x cols, plus this
//   rank's residual) of the bucket:  P = M Q;  P summed over the ranks and
//   orthogonalised (Gram-Schmidt);  Q = M^T P summed over the ranks and
//   divided by the world size;  the average is approximated by P Q^T, and
//   the residual becomes M - P Q^T.
//
// Q is kept from one iteration to the next (warm start); it starts as the
// same seeded random matrix on every rank. A matrix is compressible when
// (rows + cols) * rank * 2 < rows * cols (torch's min_compression_rate 2);
// the others, and every piece of a partitioned tensor that does not hold
// whole rows, are all-reduced as they are, in one collective. Three
// collectives per bucket: the uncompressed part, the Ps, the Qs. A warm Q
// with a zero column (left by a zero gradient) starts afresh; a non-finite
// value delivers that matrix's average as NaN and drops its residual and Q.
// Every rank
// computes from the same sums in the same order, so the averages are
// bitwise identical on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "engine/buckets/bucket_plan.h"

namespace hemiola {

class PowerSgd {
 public:
  PowerSgd(const std::vector<GradSpec>& specs, size_t rank, int world);

  // All-reduces the float32 bucket at `data` (laid out as `plan`) and leaves
  // the approximate average there; updates the residuals. `used[t]`: whether
  // this rank produced tensor t's gradient this iteration (an unused one
  // contributes zeros and keeps its residual for when it is used again).
  void reduce_average(const PlannedBucket& plan, float* data, Communicator& comm,
                      const std::vector<uint8_t>& used);
  // Tensor `index`'s residual (empty for tensors that are never compressed).
  std::vector<float>& residual(size_t index) { return residuals_[index]; }

 private:
  struct Matrix {
    size_t piece;  // k within the bucket
    size_t rows, cols, rank;
    float* q;      // this piece's warm-start Q (cols x rank, column-major)
  };
  // The piece's rows (0 when it is not compressible).
  size_t compressible_rows(const PlannedBucket& plan, size_t k) const;
  std::vector<float>& warm_q(size_t tensor, size_t begin, size_t cols, size_t rank);

  const std::vector<GradSpec>& specs_;
  const size_t rank_;
  const int world_;
  std::vector<std::vector<float>> residuals_;  // per tensor; empty: not a matrix
  std::map<std::pair<size_t, size_t>, std::vector<float>> qs_;  // (tensor, begin) -> Q
  // Scratch, reused by every bucket.
  std::vector<float> uncompressed_, ps_, qsum_, approx_;
};

}  // namespace hemiola
