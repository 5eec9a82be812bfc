// The block-scaled codings with error feedback (int8.cpp, int4.cpp): one
// algorithm, whose precision does not depend on the number of ranks.
//
// A float32 bucket of n elements is cut into blocks of kInt8Block elements,
// and the blocks into N chunks of K = ceil(blocks / N) blocks each (rank c
// owns chunk c; the last chunks may be short or empty). A block travels as a
// record: its float32 scale s, then its codes q in [-L, L] (int8: L = 127,
// one byte each; int4: L = 7, q + 7 in a nibble, two to a byte), standing for
// s * q. Coding a block: s = max |v| / L, q = rint(v / s), and v - s * q is
// what the coding dropped (the residual, fed back next time).
//
//   1. every rank adds its residual to its gradient (v) and codes every block
//      with its own scale; an all-to-all sends chunk c's records to rank c
//      (a reduce-scatter's traffic);
//   2. rank c decodes the N ranks' records of its chunk and averages them in
//      float32 (in rank order), adds its owner's residual, and codes the
//      average again with fresh scales (keeping the new owner's residual);
//   3. an all-gather of the owners' records; every rank decodes all blocks.
//
// Each rank sends 2 (N-1)/N of the coded bucket: a ring all-reduce of the
// codes. The codes are never summed on the wire, so L, and the precision,
// is the same at 2 ranks and at 200. Both codings are fed back: what the
// first coding drops waits in the sender's residual, what the second drops
// in the owner's, so over iterations nothing is lost (the sum of the
// delivered averages is the sum of the exact ones less what the residuals
// still hold). Every rank decodes the same records: the averages are
// bitwise identical across ranks.
//
// A non-finite value makes its block's scale NaN: the block's average is NaN
// on every rank (as an uncompressed all-reduce would carry it), and the
// residual that held it is reset. A block whose scale has no finite inverse
// (values below about 1e-37) is sent as zeros and kept in the residual.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/codec/codings.h"

namespace hemiola {

// How a coding's codes sit in its bytes: pack() writes `count` codes (each
// in [-kLevels, kLevels]) and unpack() reads them back, whole blocks at a
// time, in loops plain enough to vectorise.

// int8: codes in [-127, 127], one byte each.
struct Int8Codes {
  static constexpr int kLevels = 127;
  static constexpr size_t kBlockBytes = kInt8Block;
  static void pack(const int8_t* __restrict q, size_t count, uint8_t* __restrict codes) {
    std::memcpy(codes, q, count);
  }
  static void unpack(const uint8_t* __restrict codes, size_t count, int8_t* __restrict q) {
    std::memcpy(q, codes, count);
  }
};

// int4: codes in [-7, 7] as the nibble q + 7, element 2i in the low nibble of
// byte i (an odd count's last high nibble is 0).
struct Int4Codes {
  static constexpr int kLevels = 7;
  static constexpr size_t kBlockBytes = kInt8Block / 2;
  static void pack(const int8_t* __restrict q, size_t count, uint8_t* __restrict codes) {
    for (size_t k = 0; k < count / 2; ++k) {
      codes[k] = static_cast<uint8_t>((q[2 * k] + kLevels) | ((q[2 * k + 1] + kLevels) << 4));
    }
    if (count % 2) codes[count / 2] = static_cast<uint8_t>(q[count - 1] + kLevels);
  }
  static void unpack(const uint8_t* __restrict codes, size_t count, int8_t* __restrict q) {
    for (size_t k = 0; k < count / 2; ++k) {
      q[2 * k] = static_cast<int8_t>((codes[k] & 0xF) - kLevels);
      q[2 * k + 1] = static_cast<int8_t>((codes[k] >> 4) - kLevels);
    }
    if (count % 2) q[count - 1] = static_cast<int8_t>((codes[count / 2] & 0xF) - kLevels);
  }
};

namespace block_coding {

// Bytes of one block's record: the scale, then the codes.
template <typename Codes>
constexpr size_t record_bytes() {
  return sizeof(float) + Codes::kBlockBytes;
}

// Codes the `count` (at most kInt8Block) values at `v` into `record`, leaving in `v`
// what the coding dropped.
template <typename Codes>
void code(float* __restrict v, size_t count, uint8_t* __restrict record) {
  // max |v| and whether any value is infinite or NaN, over kLanes
  // independent lanes (no lane's result depends on another's order, so the
  // compiler may keep them in one vector register).
  constexpr size_t kLanes = 8;
  float lane_max[kLanes] = {};
  uint32_t lane_bad[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (size_t l = 0; l < kLanes; ++l) {
      const float a = std::fabs(v[i + l]);
      lane_max[l] = lane_max[l] < a ? a : lane_max[l];
      uint32_t bits;
      std::memcpy(&bits, &v[i + l], sizeof bits);
      lane_bad[l] |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
  }
  for (; i < count; ++i) {
    const float a = std::fabs(v[i]);
    lane_max[0] = lane_max[0] < a ? a : lane_max[0];
    uint32_t bits;
    std::memcpy(&bits, &v[i], sizeof bits);
    lane_bad[0] |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  float m = 0.0f;
  uint32_t bad = 0;
  for (size_t l = 0; l < kLanes; ++l) {
    m = std::max(m, lane_max[l]);
    bad |= lane_bad[l];
  }
  const float limit = static_cast<float>(Codes::kLevels);
  const float s = bad == 0 ? m / limit : std::numeric_limits<float>::quiet_NaN();
  std::memcpy(record, &s, sizeof s);
  // Restrict: the codes never alias the values (a byte pointer could, as far
  // as the compiler knows, and it would not vectorise).
  uint8_t* __restrict codes = record + sizeof s;
  int8_t qs[kInt8Block];
  const float inverse = 1.0f / s;
  if (std::isfinite(s) && s > 0.0f && std::isfinite(inverse)) {
    // |v * inverse| <= L (1 + 6e-7) < L + 1/2: s = m / L rounds by at most
    // 5e-7 relative even where it is subnormal (a finite inverse means s >=
    // 2.9e-39), so rint lands in [-L, L]. The integer clamp only guards that
    // bound; it is branch-free, so the loop vectorises (int8.cpp and int4.cpp
    // are built with -fno-trapping-math for the conversion: cpp/CMakeLists.txt).
    const float magic = 12582912.0f;  // 1.5 * 2^23: (x + magic) - magic == rint(x) for small x
    for (size_t j = 0; j < count; ++j) {
      const float x = v[j] * inverse;
      int q = static_cast<int>((x + magic) - magic);
      q = q < -Codes::kLevels ? -Codes::kLevels : q;
      q = q > Codes::kLevels ? Codes::kLevels : q;
      qs[j] = static_cast<int8_t>(q);
      v[j] -= s * static_cast<float>(q);
    }
  } else {
    // Zero or tiny scale: codes 0, and v stays in the residual. NaN: the
    // block decodes to NaN everywhere; the residual that held it is reset.
    const bool drop = std::isnan(s);
    for (size_t j = 0; j < count; ++j) {
      qs[j] = 0;
      if (drop) v[j] = 0.0f;
    }
  }
  Codes::pack(qs, count, codes);
}

// Decodes the `count` values of a record into `out` (Add: adds them to what
// `out` holds). The scale is read once; the loop is plain enough for the
// compiler to vectorise.
template <typename Codes, bool Add>
void decode(const uint8_t* __restrict record, size_t count, float* __restrict out) {
  float s;
  std::memcpy(&s, record, sizeof s);
  int8_t qs[kInt8Block];
  Codes::unpack(record + sizeof s, count, qs);
  for (size_t i = 0; i < count; ++i) {
    const float value = s * static_cast<float>(qs[i]);
    out[i] = Add ? out[i] + value : value;
  }
}

// Calls fn(residual, values, count) for each piece of the bucket's elements
// [first, last) (`data` holds them from `first`), with the matching slice of
// the owner's residual (the second half of each tensor's residual vector).
template <typename Fn>
void for_owned(const PlannedBucket& plan, size_t first, size_t last, float* data,
               std::vector<std::vector<float>>& residuals, Fn&& fn) {
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    const size_t lo = std::max(first, plan.offsets[k]);
    const size_t hi = std::min(last, plan.offsets[k] + plan.counts[k]);
    if (lo >= hi) continue;
    std::vector<float>& r = residuals[plan.tensors[k]];
    const size_t numel = r.size() / 2;
    fn(r.data() + numel + plan.begins[k] + (lo - plan.offsets[k]), data + (lo - first), hi - lo);
  }
}

// Where a bucket of `n` elements falls into blocks of kInt8Block and the
// blocks into `ranks` chunks of per_rank = ceil(blocks / ranks) blocks (rank c
// owns chunk c; the last chunks may be short or empty).
struct BlockChunks {
  BlockChunks(size_t numel, size_t world)
      : n(numel), ranks(world), blocks((numel + kInt8Block - 1) / kInt8Block),
        per_rank((blocks + world - 1) / world) {}
  size_t n, ranks, blocks, per_rank;
  // Elements of block blk (the last may be short).
  size_t count(size_t blk) const { return std::min(n, (blk + 1) * kInt8Block) - blk * kInt8Block; }
  size_t first_block(size_t r) const { return std::min(blocks, r * per_rank); }
  size_t last_block(size_t r) const { return std::min(blocks, first_block(r) + per_rank); }
  // The element where rank r's chunk begins (r = ranks: n).
  size_t bound(size_t r) const { return std::min(n, first_block(r) * kInt8Block); }
};

// Codes every block of `data` (leaving in it what the coding dropped) into
// scratch.send, per_rank records a rank, and sends chunk c's records to rank c
// (scratch.received: every rank's records of this rank's chunk, in rank order).
template <typename Codes>
void code_and_send(float* data, const BlockChunks& chunks, Communicator& comm,
                   BlockScratch& scratch) {
  constexpr size_t kRecord = record_bytes<Codes>();
  scratch.send.assign(chunks.ranks * chunks.per_rank * kRecord, 0);
  for (size_t blk = 0; blk < chunks.blocks; ++blk) {
    code<Codes>(data + blk * kInt8Block, chunks.count(blk), scratch.send.data() + blk * kRecord);
  }
  scratch.received.resize(scratch.send.size());
  comm.all_to_all(TensorRef{scratch.send.data(), DType::kUInt8, scratch.send.size(), Device{}},
                  TensorRef{scratch.received.data(), DType::kUInt8, scratch.received.size(),
                            Device{}});
}

// Rank me's chunk from scratch.received: each block the float32 average of
// the ranks' decoded records, summed in rank order, written from `out` on.
template <typename Codes>
void average_received(const BlockChunks& chunks, size_t me, const BlockScratch& scratch,
                      float* out) {
  constexpr size_t kRecord = record_bytes<Codes>();
  const size_t first_block = chunks.first_block(me);
  const float inverse_ranks = 1.0f / static_cast<float>(chunks.ranks);
  for (size_t blk = first_block; blk < chunks.last_block(me); ++blk) {
    float* average = out + (blk - first_block) * kInt8Block;
    const size_t count = chunks.count(blk);
    std::fill(average, average + count, 0.0f);
    for (size_t r = 0; r < chunks.ranks; ++r) {
      decode<Codes, true>(
          scratch.received.data() + (r * chunks.per_rank + (blk - first_block)) * kRecord, count,
          average);
    }
    for (size_t i = 0; i < count; ++i) average[i] *= inverse_ranks;
  }
}

}  // namespace block_coding

// All-reduces (averages) the float32 bucket at `data`, laid out as `plan`,
// in place (see above). `residuals[t]`: tensor t's error feedback, 2 x its
// elements (this rank's coding's, then the owner's); `used[t]`: whether this
// rank produced tensor t's gradient (an unused one sends zeros and keeps its
// residual). `scratch`: reused buffers.
template <typename Codes>
void reduce_in_blocks(const PlannedBucket& plan, float* data, Communicator& comm,
                      const std::vector<uint8_t>& used,
                      std::vector<std::vector<float>>& residuals, BlockScratch& scratch) {
  using namespace block_coding;
  constexpr size_t kRecord = record_bytes<Codes>();
  const BlockChunks chunks(plan.numel, static_cast<size_t>(comm.size()));
  const size_t me = static_cast<size_t>(comm.rank());
  // 1. v = gradient + residual, coded block by block with this rank's
  // scales, each chunk's records sent to its owner.
  add_residuals(plan, data, residuals, used);
  code_and_send<Codes>(data, chunks, comm, scratch);
  keep_residuals(plan, data, residuals, used);
  // 2. This rank's chunk: the ranks' records decoded and averaged in
  // float32, the owner's residual added, coded again.
  const size_t first_block = chunks.first_block(me), last_block = chunks.last_block(me);
  const size_t first = chunks.bound(me), last = chunks.bound(me + 1);
  scratch.average.resize(last - first);
  average_received<Codes>(chunks, me, scratch, scratch.average.data());
  for_owned(plan, first, last, scratch.average.data(), residuals,
            [](float* residual, float* v, size_t count) {
              for (size_t i = 0; i < count; ++i) v[i] += residual[i];
            });
  scratch.mine.assign(chunks.per_rank * kRecord, 0);
  for (size_t blk = first_block; blk < last_block; ++blk) {
    code<Codes>(scratch.average.data() + (blk - first_block) * kInt8Block, chunks.count(blk),
                scratch.mine.data() + (blk - first_block) * kRecord);
  }
  for_owned(plan, first, last, scratch.average.data(), residuals,
            [](float* residual, float* v, size_t count) { std::copy(v, v + count, residual); });
  // 3. Every owner's records, decoded on every rank alike.
  scratch.gathered.resize(chunks.ranks * chunks.per_rank * kRecord);
  comm.all_gather(TensorRef{scratch.mine.data(), DType::kUInt8, scratch.mine.size(), Device{}},
                  TensorRef{scratch.gathered.data(), DType::kUInt8, scratch.gathered.size(),
                            Device{}});
  for (size_t blk = 0; blk < chunks.blocks; ++blk) {
    decode<Codes, false>(scratch.gathered.data() + blk * kRecord, chunks.count(blk),
                         data + blk * kInt8Block);
  }
}

// Steps 1 and 2 of reduce_in_blocks without the owner's second coding, for a
// reduce-scatter (Engine::reduce_scatter_coded): `residual` (n floats) is
// added to `data`, every block coded with this rank's scales (what the coding
// drops goes back to `residual`), chunk c's records go to rank c, and this
// rank's chunk of `data` (BlockChunks::bound) receives the float32 average of
// the ranks' decoded records, summed in rank order. Outside that chunk `data`
// is left holding what the coding dropped.
template <typename Codes>
void reduce_scatter_in_blocks(float* data, float* residual, size_t n, Communicator& comm,
                              BlockScratch& scratch) {
  using namespace block_coding;
  const BlockChunks chunks(n, static_cast<size_t>(comm.size()));
  const size_t me = static_cast<size_t>(comm.rank());
  for (size_t i = 0; i < n; ++i) data[i] += residual[i];
  code_and_send<Codes>(data, chunks, comm, scratch);
  std::memcpy(residual, data, n * sizeof(float));
  average_received<Codes>(chunks, me, scratch, data + chunks.bound(me));
}

}  // namespace hemiola
