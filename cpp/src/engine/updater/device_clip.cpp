// engine/device_clip.h.
#include "engine/updater/device_clip.h"

#include <algorithm>

#include "hemiola/status.h"

namespace hemiola {

DeviceClip::DeviceClip(int device, const std::vector<DType>& dtypes)
    : count_(dtypes.size()),
      dtypes_(device, std::max<size_t>(dtypes.size(), 1) * sizeof(std::int32_t)),
      sums_(device, std::max<size_t>(dtypes.size(), 1) * sizeof(double)),
      out_(device, kSlots * 2 * sizeof(double)),
      host_(kSlots * sizeof(double)) {
  std::vector<std::int32_t> codes(dtypes.size());
  std::transform(dtypes.begin(), dtypes.end(), codes.begin(),
                 [](DType d) { return static_cast<std::int32_t>(d); });
  cuda::Stream upload(device);
  if (!codes.empty()) {
    cuda::copy_async(dtypes_.data(), codes.data(), codes.size() * sizeof(std::int32_t),
                     upload.get());
  }
  // `codes` dies here; the device buffers' zero-fill ran on the legacy
  // default stream, which the updater's non-blocking streams do not wait for.
  cuda::synchronize(upload.get());
  cuda::synchronize(nullptr);
  for (auto& event : copied_) event = std::make_unique<cuda::Event>(device);
}

const double* DeviceClip::compute(uint64_t iteration, const std::vector<cuda::NormInput>& inputs,
                                  double norm_type, double max_norm, void* stream) {
  HEMIOLA_CHECK(inputs.size() == count_, "device clip: ", inputs.size(),
                " gradients for ", count_, " parameters");
  const size_t slot = iteration % kSlots;
  double* out = static_cast<double*>(out_.data()) + 2 * slot;
  cuda::clip_coefficient(inputs.data(), inputs.size(),
                         static_cast<const std::int32_t*>(dtypes_.data()),
                         static_cast<double*>(sums_.data()), norm_type, max_norm, out, stream);
  cuda::copy_async(static_cast<double*>(host_.data()) + slot, out + 1, sizeof(double), stream);
  copied_[slot]->record(stream);
  iteration_[slot] = iteration;
  return out;
}

std::optional<double> DeviceClip::total_norm(uint64_t iteration) const {
  const size_t slot = iteration % kSlots;
  if (iteration_[slot] != iteration || !copied_[slot]->query()) return std::nullopt;
  return static_cast<const double*>(host_.data())[slot];
}

}  // namespace hemiola
