// kInt4: half a byte per float32 element of a host bucket (plus a float32
// scale per block of kInt8Block), with error feedback, at any number of
// ranks: block_coding.h's algorithm with codes in [-7, 7], two to a byte.
#include "engine/codec/block_coding.h"

namespace hemiola {

namespace {

class Int4Host final : public BlockCodedHost {
 public:
  explicit Int4Host(const CodecSpec& spec) : BlockCodedHost(Compression::kInt4, spec) {}

 protected:
  void reduce(const PlannedBucket& plan, float* data, Communicator& comm,
              const std::vector<uint8_t>& used) override {
    reduce_in_blocks<Int4Codes>(plan, data, comm, used, residuals_, scratch_);
  }
};

}  // namespace

std::unique_ptr<Codec> make_int4_codec(const CodecSpec& spec) {
  return std::make_unique<Int4Host>(spec);
}

}  // namespace hemiola
