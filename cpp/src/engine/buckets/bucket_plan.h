// Bucket assignment: which gradients are fused into which bucket, and in what
// order buckets are issued. A pure function of the tensor specs, an order and
// the caps, so every rank computes the same plan from the same inputs.
#pragma once

#include <cstddef>
#include <vector>

#include "hemiola/tensor.h"

namespace hemiola {

// A bucket holds pieces of tensors: whole tensors, or, for a partitioned
// tensor, a contiguous range of its elements. Entry k is elements
// [begins[k], begins[k] + counts[k]) of tensor tensors[k], stored at element
// offsets[k] of the bucket.
struct PlannedBucket {
  DType dtype = DType::kFloat32;
  std::vector<size_t> tensors;  // indices into the specs, in pack order
  std::vector<size_t> begins;   // first element of the piece within its tensor
  std::vector<size_t> counts;   // elements in the piece
  std::vector<size_t> offsets;  // element offset of the piece in the bucket
  size_t numel = 0;
  size_t nbytes() const { return numel * dtype_size(dtype); }
};

// Where a piece of a tensor lives in a plan (one piece unless the tensor is
// partitioned).
struct Placement {
  size_t bucket = 0;
  size_t offset = 0;  // in elements, within the bucket
  size_t begin = 0;   // first element of the piece within the tensor
  size_t count = 0;   // elements in the piece
};

// Walks `order` (a permutation of the spec indices: the order in which
// gradients are expected to become ready) and fills one open bucket per dtype.
// A tensor larger than `partition_bytes` (when non-zero) is cut into pieces of
// at most that size, placed one after another as if they were tensors. A
// bucket closes as soon as it holds at least its cap: the piece that reaches
// the cap is its last (torch DDP's rule). Closing *before* such a piece
// instead would leave a large gradient waiting in the next bucket for the
// gradients behind it, and the link idle meanwhile: with a 1 MiB first cap,
// the last layer's big weight would wait for the whole layer before it. The
// first bucket to close is capped at `first_cap_bytes`, the rest at
// `cap_bytes`. Buckets are returned in plan order: by the position in `order`
// of their first piece.
std::vector<PlannedBucket> plan_buckets(const std::vector<GradSpec>& specs,
                                        const std::vector<size_t>& order, size_t first_cap_bytes,
                                        size_t cap_bytes, size_t partition_bytes = 0);

// Per tensor (0..tensors-1), its pieces in `plan`, in plan order.
std::vector<std::vector<Placement>> place_pieces(const std::vector<PlannedBucket>& plan,
                                                 size_t tensors);

// The initial order: reverse registration order (backward produces the last
// layers' gradients first).
std::vector<size_t> reverse_order(size_t n);

// Throws unless `order` is a permutation of 0..n-1.
void check_permutation(const std::vector<size_t>& order, size_t n);

}  // namespace hemiola
