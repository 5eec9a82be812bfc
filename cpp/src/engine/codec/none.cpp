// The coding "none": a bucket travels as it is, on the host or on a CUDA
// device; its plain sends are also what every other coding falls back to for
// a bucket it does not compress (codings.h).
#include "engine/codec/codings.h"

namespace hemiola {

double send_plain_host(BucketStorage& storage, size_t b, Communicator& host, double scale) {
  const PlannedBucket& plan = storage.layout().plan[b];
  host.all_reduce_sum(TensorRef{storage.buffer(b), plan.dtype, plan.numel, Device{}});
  return scale;
}

double send_plain_device(BucketStorage& storage, size_t b, const Device& here, bool average) {
  const PlannedBucket& plan = storage.layout().plan[b];
  storage.device_comm()->all_reduce(TensorRef{storage.buffer(b), plan.dtype, plan.numel, here},
                                    average, storage.stream());
  return 1.0;  // averaged in the reduction itself
}

namespace {

class NoneHost final : public Codec {
 public:
  explicit NoneHost(const CodecSpec& spec)
      : Codec(Compression::kNone), scale_(plain_scale(spec)) {}

 protected:
  double send(BucketStorage& storage, size_t b, uint64_t, Communicator& host) override {
    return send_plain_host(storage, b, host, scale_);
  }

 private:
  const double scale_;  // 1/world when averaging
};

class NoneDevice final : public Codec {
 public:
  explicit NoneDevice(const CodecSpec& spec)
      : Codec(Compression::kNone), here_(spec.device), average_(spec.average) {}

 protected:
  double send(BucketStorage& storage, size_t b, uint64_t, Communicator&) override {
    return send_plain_device(storage, b, here_, average_);
  }

 private:
  const Device here_;
  const bool average_;
};

}  // namespace

std::unique_ptr<Codec> make_none_codec(const CodecSpec& spec) {
  if (spec.device.type == DeviceType::kCUDA) return std::make_unique<NoneDevice>(spec);
  return std::make_unique<NoneHost>(spec);
}

}  // namespace hemiola
