// The outer lane: one fragment's average per unit of work on the "outer" wire.
#include "engine/reducer/outer_lane.h"

#include <string>

#include "core/dtype_math.h"
#include "hemiola/status.h"

namespace hemiola {

class OuterLane::Average final : public Work {
 public:
  Average(OuterLane& lane, size_t fragment, unsigned char* buffer, uint64_t round)
      : lane_(lane), fragment_(fragment), buffer_(buffer), round_(round) {}

  void run(Communicator& comm, Timeline& timeline) override {
    const int64_t start_us = timeline.now_us();
    const PlannedBucket& plan = lane_.fragments_[fragment_];
    WireCodec* codec = lane_.codec_.get();
    if (codec != nullptr && codec->applies(plan, round_)) {
      codec->reduce_average(plan, buffer_, comm, round_, lane_.used_);
    } else {
      comm.all_reduce_sum(TensorRef{buffer_, plan.dtype, plan.numel, Device{}});
      scale_in_place(plan.dtype, buffer_, plan.numel, 1.0 / lane_.host_.options().world_size);
    }
    if (timeline.enabled()) {
      timeline.record("outer", describe(), "outer", start_us, timeline.now_us());
    }
  }
  std::string describe() const override {
    return "outer average of fragment " + std::to_string(fragment_) + " (sync " +
           std::to_string(round_) + ")";
  }

 private:
  OuterLane& lane_;
  const size_t fragment_;
  unsigned char* const buffer_;
  const uint64_t round_;
};

OuterLane::OuterLane(LaneHost& host, const std::vector<GradSpec>& specs,
                     const std::vector<PlannedBucket>& fragments, Compression compression)
    : host_(host),
      fragments_(fragments),
      compression_(compression),
      wire_(host.connect_wire("outer")),
      used_(specs.size(), 1) {
  HEMIOLA_CHECK(compression == Compression::kNone || compression == Compression::kFp16 ||
                    compression == Compression::kBf16 || compression == Compression::kInt8,
                "streaming sends its pseudo-gradients with compression none, fp16, bf16 or "
                "int8");
  if (compression != Compression::kNone) {
    ReducerOptions options;
    options.compression = compression;
    codec_ = std::make_unique<WireCodec>(options, specs, host.options().world_size);
  }
}

Handle OuterLane::average(size_t f, unsigned char* buffer, uint64_t round) {
  HEMIOLA_CHECK(f < fragments_.size(), "fragment ", f, " is out of range");
  return host_.submit(wire_, std::make_shared<Average>(*this, f, buffer, round));
}

std::vector<float>& OuterLane::residual(size_t index) {
  HEMIOLA_CHECK(compression_ == Compression::kInt8,
                "residual() needs compression int8 (error feedback)");
  return codec_->residual(index);
}

}  // namespace hemiola
