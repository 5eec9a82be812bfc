// The fragment averager: one fragment's average per unit of work on the
// "outer" wire.
#include "engine/streaming/fragment_averager.h"

#include <string>

#include "hemiola/status.h"

namespace hemiola {

namespace {

// "none, fp16, bf16, int8 or int4": the codings streaming may send with.
std::string streaming_codings() {
  return listed(coding_names([](const Coding& c) { return c.streams; }), "or");
}

}  // namespace

class FragmentAverager::Average final : public Work {
 public:
  Average(FragmentAverager& averager, size_t fragment, uint64_t round)
      : averager_(averager), fragment_(fragment), round_(round) {}

  void run(Communicator& comm, Timeline& timeline) override {
    const int64_t start_us = timeline.now_us();
    averager_.codec_->reduce(*averager_.storage_, fragment_, round_, averager_.outs_, comm);
    if (timeline.enabled()) {
      timeline.record("outer", describe(), "outer", start_us, timeline.now_us());
    }
  }
  std::string describe() const override {
    return "outer average of fragment " + std::to_string(fragment_) + " (sync " +
           std::to_string(round_) + ")";
  }

 private:
  FragmentAverager& averager_;
  const size_t fragment_;
  const uint64_t round_;
};

FragmentAverager::FragmentAverager(Scheduler& scheduler, const BucketLayout& fragments,
                                   Compression compression)
    : scheduler_(scheduler),
      wire_(scheduler.connect_wire("outer")),
      storage_(make_host_buckets(fragments)),
      outs_(fragments.specs.size(), nullptr) {
  HEMIOLA_CHECK(coding(compression).streams, "streaming sends its pseudo-gradients with "
                "compression ", streaming_codings());
  codec_ = make_codec(CodecSpec{fragments.specs, Device{}, compression, /*average=*/true,
                                scheduler.options().world_size});
}

unsigned char* FragmentAverager::sending(size_t f) const {
  HEMIOLA_CHECK(f < storage_->layout().plan.size(), "fragment ", f, " is out of range");
  return storage_->buffer(f);
}

Handle FragmentAverager::submit(size_t f, uint64_t round) {
  return scheduler_.submit(wire_, std::make_shared<Average>(*this, f, round));
}

const unsigned char* FragmentAverager::averaged(size_t f) const {
  HEMIOLA_CHECK(f < storage_->layout().plan.size(), "fragment ", f, " is out of range");
  return storage_->buffer(f);
}

std::vector<float>& FragmentAverager::residual(size_t index) {
  std::vector<float>* r = codec_->residual(index);
  HEMIOLA_CHECK(r != nullptr, "residual() needs compression ",
                listed(coding_names([](const Coding& c) { return c.streams && c.residuals; }),
                       "or"),
                " (error feedback)");
  return *r;
}

}  // namespace hemiola
