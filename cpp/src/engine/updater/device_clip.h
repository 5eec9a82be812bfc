// clip_grad_norm_ of an iteration's averaged gradients on the GPU
// (cuda::clip_coefficient), so that the host never waits for a reduction to
// clip: the optimizer steps enqueued after it read the coefficient from
// device memory (SgdHyper::grad_scale_device). The total norm, which
// clip_grad_norm_ returns to the user, is copied to pinned memory behind the
// kernel and read once that copy's event has passed.
//
// One instance per Updater on a GPU, made when UpdaterOptions::
// device_clip_norms is set and the engine steps itself. Everything is
// enqueued on the stream the caller passes (the updater's one order).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "cuda/device.h"
#include "hemiola/tensor.h"
#include "optim/norm_kernels.h"

namespace hemiola {

class DeviceClip {
 public:
  // `dtypes`: every parameter's, in order (uploaded once; waits for it).
  DeviceClip(int device, const std::vector<DType>& dtypes);

  // Enqueues the coefficient of iteration `iteration`'s gradients `inputs`
  // (one per parameter, in order; zeros for a parameter no rank used) on
  // `stream`. Returns where the steps read it: valid for work enqueued on
  // that stream until the same slot serves iteration + kSlots.
  const double* compute(uint64_t iteration, const std::vector<cuda::NormInput>& inputs,
                        double norm_type, double max_norm, void* stream);
  // The total norm of `iteration` once its copy has completed; nullopt
  // before that or when it was not clipped here (never waits).
  std::optional<double> total_norm(uint64_t iteration) const;

 private:
  // More than the iterations that can be pending at once (in_flight <= 3,
  // plus the one being stepped).
  static constexpr size_t kSlots = 8;

  size_t count_;
  cuda::DeviceBuffer dtypes_;  // count_ int32 DType codes
  cuda::DeviceBuffer sums_;    // count_ doubles of scratch
  cuda::DeviceBuffer out_;     // per slot: coefficient, total norm
  cuda::PinnedBuffer host_;    // per slot: the total norm, copied behind the kernel
  std::array<std::unique_ptr<cuda::Event>, kSlots> copied_;
  std::array<std::optional<uint64_t>, kSlots> iteration_;  // what each slot holds
};

}  // namespace hemiola
