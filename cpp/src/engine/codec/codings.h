// The codings behind the factory (factory.cpp): one constructor per coding
// and device, and the plain send every coding falls back to for a bucket it
// does not apply to. Only the codec's own files include this.
#pragma once

#include <cstddef>
#include <memory>

#include "engine/codec/codec.h"

namespace hemiola {

// Elements that share one int8 scale.
constexpr size_t kInt8Block = 256;

// Whether a coding can compress bucket `plan` at all: float32 buckets only,
// others travel as they are.
inline bool compressible(const PlannedBucket& plan) {
  return plan.dtype == DType::kFloat32 && plan.numel > 0;
}

// What an uncompressed host bucket's sum is scaled by: 1/world when averaging.
inline double plain_scale(const CodecSpec& spec) {
  return spec.average ? 1.0 / spec.world_size : 1.0;
}

// An uncompressed bucket on the host: summed by the host communicator; the
// result is still to be scaled by 1/world when averaging (returned).
double send_plain_host(BucketStorage& storage, size_t b, Communicator& host, double scale);
// An uncompressed bucket on device `here`: all-reduced (averaged if
// `average`) by the storage's device communicator on its stream.
double send_plain_device(BucketStorage& storage, size_t b, const Device& here, bool average);

std::unique_ptr<Codec> make_none_codec(const CodecSpec& spec);
std::unique_ptr<Codec> make_half_codec(const CodecSpec& spec);  // host or CUDA
std::unique_ptr<Codec> make_int8_codec(const CodecSpec& spec);  // host
std::unique_ptr<Codec> make_powersgd_codec(const CodecSpec& spec);  // host

}  // namespace hemiola
