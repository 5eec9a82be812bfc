// How a bucket travels: the one seam between a bucket's memory (its storage,
// engine/buckets/bucket_storage.h) and the wire. One implementation per
// coding (ReducerOptions::compression), each for the devices it runs on:
//   - none (none.cpp): the bucket as it is, summed (host: then scaled by
//     1/world when averaging; device: averaged by the collective);
//   - half (half.cpp): kFp16 / kBf16, two bytes per float32 element, host
//     and CUDA;
//   - int8 (int8.cpp): one byte per element with error feedback, host;
//   - int4 (int4.cpp): half a byte per element with error feedback, host,
//     at most 7 ranks;
//   - PowerSGD (powersgd.cpp): low rank with error feedback, host.
// Buckets a coding does not apply to (not float32, empty, or in PowerSGD's
// warm-up) travel as none sends them. Which coding runs on which device is
// the factory's table (factory.cpp, hemiola::codings()); make_codec refuses
// any other pairing, naming what works there.
//
// Threads: reduce() runs on the engine's scheduler thread only, one bucket at
// a time, in iteration order (so iteration t's residual is written before
// t+1 reads it). residual() is read between iterations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "engine/buckets/bucket_plan.h"
#include "engine/buckets/bucket_storage.h"
#include "hemiola/config.h"

namespace hemiola {

// What a codec is made for.
struct CodecSpec {
  // The reducer's gradients (residuals are kept per tensor, so they survive
  // a rebuild of the bucket plan); must outlive the codec.
  const std::vector<GradSpec>& specs;
  Device device;  // where the buckets live: the host or one CUDA device
  Compression compression = Compression::kNone;
  bool average = true;  // the result is the average (else the sum)
  int world_size = 1;
  size_t powersgd_rank = 2;
  uint64_t powersgd_start_iteration = 0;  // kPowerSgd: uncompressed before
};

class Codec {
 public:
  virtual ~Codec() = default;

  Compression compression() const { return compression_; }

  // Bucket b of `storage`, in iteration `iteration`: waits for its copies,
  // all-reduces it (averaged if the reducer averages) and writes each
  // piece's result to `outs[tensor]` where that is not null. `host`: the
  // scheduler's host communicator (a device storage reduces on its own).
  void reduce(BucketStorage& storage, size_t b, uint64_t iteration,
              const std::vector<void*>& outs, Communicator& host);

  // Per bucket of `plan`: the wire memory a device storage keeps for this
  // coding (empty: none).
  virtual std::vector<size_t> wire_bytes(const std::vector<PlannedBucket>& plan) const {
    return {};
  }
  // kInt8, kInt4 and kPowerSgd: tensor `index`'s residual (float32, one per
  // element; empty for tensors never compressed). Null for the codings
  // without error feedback.
  virtual std::vector<float>* residual(size_t index) { return nullptr; }

 protected:
  explicit Codec(Compression compression) : compression_(compression) {}
  // Sends bucket b (its copies are in) and leaves its result in the
  // bucket's buffer; returns what that result is still to be scaled by.
  virtual double send(BucketStorage& storage, size_t b, uint64_t iteration,
                      Communicator& host) = 0;

 private:
  const Compression compression_;
};

// The one factory: the coding `spec` asks for on `spec.device`, or an error
// naming what runs there.
std::unique_ptr<Codec> make_codec(const CodecSpec& spec);

}  // namespace hemiola
