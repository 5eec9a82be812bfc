// Which elements of a tensor each rank holds after a ring reduce-scatter: the
// chunks of Gloo's ring all-reduce. Its first half leaves chunk r's sum on rank
// r, added up along the ring in an order fixed by r alone, so a reduce-scatter
// over the same chunks, summed in the same order, is bitwise the all-reduce's
// result there (what makes `sharded` equal `wfbp` bit for bit at any count).
#pragma once

#include <cstddef>
#include <vector>

namespace hemiola {

// Gloo's cap on one ring segment (AllreduceOptions::kMaxSegmentSize).
inline constexpr size_t kRingMaxSegmentBytes = size_t{1} << 20;

// world_size + 1 element offsets: chunk r is [bounds[r], bounds[r + 1]). Chunks
// are contiguous, in rank order, and cover the tensor; the last ones may be
// short or empty (a chunk is a whole number of segments, each at most
// kRingMaxSegmentBytes and at least two per rank).
std::vector<size_t> ring_chunks(size_t numel, size_t element_size, int world_size);

}  // namespace hemiola
