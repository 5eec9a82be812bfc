#include "comm/ring_chunks.h"

#include <algorithm>

#include "hemiola/status.h"

namespace hemiola {

namespace {

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

std::vector<size_t> ring_chunks(size_t numel, size_t element_size, int world_size) {
  HEMIOLA_CHECK(world_size >= 1, "ring_chunks: world_size ", world_size, " < 1");
  HEMIOLA_CHECK(element_size >= 1, "ring_chunks: element size 0");
  const size_t world = static_cast<size_t>(world_size);
  std::vector<size_t> bounds(world + 1, numel);
  bounds[0] = 0;
  if (numel == 0 || world == 1) return bounds;
  const size_t total = numel * element_size;
  // The ring's geometry: at least two segments per rank (one on the wire
  // while the other is summed), each a whole number of elements and at most
  // the segment cap; as many segments for every rank.
  const size_t cap = element_size * (kRingMaxSegmentBytes / element_size);
  const size_t segment =
      round_up(std::min((total + 2 * world - 1) / (2 * world), cap), element_size);
  const size_t segments = round_up(std::max((total + segment - 1) / segment, 2 * world), world);
  const size_t chunk_bytes = segments / world * segment;
  for (size_t r = 1; r < world; ++r) bounds[r] = std::min(r * chunk_bytes, total) / element_size;
  return bounds;
}

}  // namespace hemiola
