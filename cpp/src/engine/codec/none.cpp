// The coding "none": a bucket travels as it is (codec.cpp's plain sends), on
// the host or on a CUDA device.
#include "engine/codec/codings.h"

namespace hemiola {

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
