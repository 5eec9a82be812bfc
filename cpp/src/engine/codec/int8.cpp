// kInt8: one byte per float32 element of a host bucket (plus a float32 scale
// per block of kInt8Block), with error feedback, at any number of ranks:
// block_coding.h's algorithm with codes in [-127, 127].
#include "engine/codec/block_coding.h"

namespace hemiola {

namespace {

class Int8Host final : public BlockCodedHost {
 public:
  explicit Int8Host(const CodecSpec& spec) : BlockCodedHost(Compression::kInt8, spec) {}

 protected:
  void reduce(const PlannedBucket& plan, float* data, Communicator& comm,
              const std::vector<uint8_t>& used) override {
    reduce_in_blocks<Int8Codes>(plan, data, comm, used, residuals_, scratch_);
  }
};

}  // namespace

std::unique_ptr<Codec> make_int8_codec(const CodecSpec& spec) {
  return std::make_unique<Int8Host>(spec);
}

}  // namespace hemiola
