// The outer lane: one fragment's average per unit of work on the "outer" wire.
#include "engine/reducer/outer_lane.h"

#include <string>

#include "hemiola/status.h"

namespace hemiola {

class OuterLane::Average final : public Work {
 public:
  Average(OuterLane& lane, size_t fragment, uint64_t round)
      : lane_(lane), fragment_(fragment), round_(round) {}

  void run(Communicator& comm, Timeline& timeline) override {
    const int64_t start_us = timeline.now_us();
    lane_.codec_->reduce(*lane_.storage_, fragment_, round_, lane_.outs_, comm);
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
  const uint64_t round_;
};

OuterLane::OuterLane(LaneHost& host, const BucketLayout& fragments, Compression compression)
    : host_(host),
      wire_(host.connect_wire("outer")),
      storage_(make_host_buckets(fragments)),
      outs_(fragments.specs.size(), nullptr) {
  HEMIOLA_CHECK(compression == Compression::kNone || compression == Compression::kFp16 ||
                    compression == Compression::kBf16 || compression == Compression::kInt8 ||
                    compression == Compression::kInt4,
                "streaming sends its pseudo-gradients with compression none, fp16, bf16, int8 "
                "or int4");
  codec_ = make_codec(CodecSpec{fragments.specs, Device{}, compression, /*average=*/true,
                                host.options().world_size});
}

Handle OuterLane::average(size_t f, uint64_t round) {
  HEMIOLA_CHECK(f < storage_->layout().plan.size(), "fragment ", f, " is out of range");
  return host_.submit(wire_, std::make_shared<Average>(*this, f, round));
}

std::vector<float>& OuterLane::residual(size_t index) {
  std::vector<float>* r = codec_->residual(index);
  HEMIOLA_CHECK(r != nullptr, "residual() needs compression int8 or int4 (error feedback)");
  return *r;
}

}  // namespace hemiola
