// How a bucket travels: the one seam between a bucket's memory (its storage,
// engine/buckets/bucket_storage.h) and the wire. One implementation per
// coding (ReducerOptions::compression):
//   - none (none.cpp): the bucket as it is, summed (host: then scaled by
//     1/world when averaging; device: averaged by the collective);
//   - half (half.cpp): kFp16 / kBf16, two bytes per float32 element;
//   - int8 (int8.cpp): one byte per element with error feedback;
//   - int4 (int4.cpp): half a byte per element with error feedback, at most
//     7 ranks;
//   - PowerSGD (powersgd.cpp): low rank with error feedback.
// Every coding shares one frame (Codec::reduce, codec.cpp): await the
// bucket's copies, send(), copy the result out. Buckets a coding does not
// apply to (not float32, empty, or in PowerSGD's warm-up) travel as none
// sends them (none.cpp's plain sends). Every other fact about a coding
// (which devices it runs on, whether streaming may send with it, whether it
// keeps residuals) is the factory's table (factory.cpp, hemiola::codings()),
// and code that needs one asks coding(c); make_codec refuses any pairing
// the table does not list, naming what works there.
//
// Threads: reduce() runs on the engine's scheduler thread only, one bucket at
// a time, in iteration order (so iteration t's residual is written before
// t+1 reads it). residual() is read between iterations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
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
  // For a coding whose table row says `residuals`: tensor `index`'s
  // error-feedback residual (float32, one per element; empty for tensors
  // never compressed). Null for every other coding.
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

// The names of the codings for which `has` holds, in table order (codings()):
// a refusal names what works from the table, so it stays true as the table
// grows.
std::vector<const char*> coding_names(const std::function<bool(const Coding&)>& has);
// "a", "a or b", "a, b or c" (`conjunction`: "or", "and").
std::string listed(const std::vector<const char*>& names, const char* conjunction);

}  // namespace hemiola
