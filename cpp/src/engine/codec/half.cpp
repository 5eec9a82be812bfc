// kFp16 / kBf16: a float32 bucket travels as two bytes per element. Each rank
// casts its bucket to the half type and divides by the world size there (so
// the sum cannot overflow where the gradients themselves did not), the halves
// are summed, and the sum is cast back: what torch DDP's fp16_compress_hook
// and bf16_compress_hook do, rounding for rounding. The same on the host
// (core/half_cast.h) and on a CUDA device (the cast kernels, on the engine's
// stream).
#include <cstdint>
#include <vector>

#include "core/half_cast.h"
#include "engine/codec/cast_kernels.h"
#include "engine/codec/codings.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

DType half_of(Compression compression) {
  return compression == Compression::kFp16 ? DType::kFloat16 : DType::kBFloat16;
}

class HalfHost final : public Codec {
 public:
  explicit HalfHost(const CodecSpec& spec)
      : Codec(spec.compression), half_(half_of(spec.compression)), world_(spec.world_size),
        scale_(plain_scale(spec)) {}

 protected:
  double send(BucketStorage& storage, size_t b, uint64_t, Communicator& comm) override {
    const PlannedBucket& plan = storage.layout().plan[b];
    if (!compressible(plan)) return send_plain_host(storage, b, comm, scale_);
    float* data = reinterpret_cast<float*>(storage.buffer(b));
    const size_t n = plan.numel;
    halves_.resize(n);
    // Cast, then divide in the half type (the division rounds to it again),
    // as torch's hooks do: buffer.to(half).div_(world_size).
    floats_to_halves(half_, data, halves_.data(), n, static_cast<float>(world_));
    comm.all_reduce_sum(TensorRef{halves_.data(), half_, n, Device{}});
    halves_to_floats(half_, halves_.data(), data, n);
    return 1.0;  // averaged on the wire
  }

 private:
  const DType half_;
  const int world_;
  const double scale_;  // an uncompressed bucket's: 1/world when averaging
  std::vector<uint16_t> halves_;  // scratch, reused by every bucket: the wire
};

class HalfDevice final : public Codec {
 public:
  explicit HalfDevice(const CodecSpec& spec)
      : Codec(spec.compression), half_(half_of(spec.compression)), world_(spec.world_size),
        here_(spec.device), average_(spec.average) {}

  // float32 buckets travel in the half type, cast into the storage's wire
  // memory; others as they are.
  std::vector<size_t> wire_bytes(const std::vector<PlannedBucket>& plan) const override {
    std::vector<size_t> bytes;
    for (const auto& bucket : plan) bytes.push_back(compressible(bucket) ? 2 * bucket.numel : 0);
    return bytes;
  }

 protected:
  double send(BucketStorage& storage, size_t b, uint64_t, Communicator&) override {
    const PlannedBucket& plan = storage.layout().plan[b];
    if (!compressible(plan)) return send_plain_device(storage, b, here_, average_);
    // As on the host: each rank's share in half precision, summed on the
    // wire, widened back into the bucket.
    void* wire = storage.wire(b);
    void* stream = storage.stream();
    cuda::cast_divide(reinterpret_cast<const float*>(storage.buffer(b)), wire, half_,
                      static_cast<std::int64_t>(plan.numel), static_cast<float>(world_), stream);
    storage.device_comm()->all_reduce(TensorRef{wire, half_, plan.numel, here_},
                                      /*average=*/false, stream);
    cuda::cast(wire, half_, storage.buffer(b), DType::kFloat32,
               static_cast<std::int64_t>(plan.numel), stream);
    return 1.0;  // averaged by the wire's division
  }

 private:
  const DType half_;
  const int world_;
  const Device here_;
  const bool average_;
};

}  // namespace

std::unique_ptr<Codec> make_half_codec(const CodecSpec& spec) {
  if (spec.device.type == DeviceType::kCUDA) return std::make_unique<HalfDevice>(spec);
  return std::make_unique<HalfHost>(spec);
}

}  // namespace hemiola
