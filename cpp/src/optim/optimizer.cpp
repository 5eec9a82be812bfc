// hemiola/optimizer.h: checks the arguments as torch.optim does, then runs
// the step on the tensor's device.
#include "hemiola/optimizer.h"

#include "hemiola/status.h"
#include "optim/cpu_optimizer.h"
#include "optim/step_kernels.h"

namespace hemiola {

namespace {

void check_common(const void* param, const void* shadow, const void* grad, std::int64_t numel,
                  DType dtype) {
  HEMIOLA_CHECK(numel >= 0, "optimizer step: negative element count ", numel);
  HEMIOLA_CHECK(is_floating(dtype), "optimizer step: dtype ", dtype_name(dtype),
                " is not a floating dtype");
  HEMIOLA_CHECK(numel == 0 || (param && shadow && grad),
                "optimizer step: null parameter, shadow or gradient");
}

}  // namespace

bool operator==(const OptimizerHyper& a, const OptimizerHyper& b) {
  return a.lr == b.lr && a.momentum == b.momentum && a.dampening == b.dampening &&
         a.weight_decay == b.weight_decay && a.nesterov == b.nesterov &&
         a.maximize == b.maximize && a.beta1 == b.beta1 && a.beta2 == b.beta2 &&
         a.eps == b.eps && a.amsgrad == b.amsgrad;
}

OptimizerKind optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown optimizer '", name,
                "': the engine steps 'sgd', 'adam' and 'adamw'");
}

namespace {

// torch.optim.SGD's argument checks, and the buffer this step needs.
void check_sgd(const SgdTensors& tensors, std::int64_t numel, DType dtype, const SgdHyper& hyper,
               bool commit) {
  check_common(tensors.param, tensors.shadow, tensors.grad, numel, dtype);
  HEMIOLA_CHECK(hyper.lr >= 0.0, "sgd: invalid learning rate ", hyper.lr);
  HEMIOLA_CHECK(hyper.momentum >= 0.0, "sgd: invalid momentum ", hyper.momentum);
  HEMIOLA_CHECK(hyper.weight_decay >= 0.0, "sgd: invalid weight_decay ", hyper.weight_decay);
  HEMIOLA_CHECK(!hyper.nesterov || (hyper.momentum > 0.0 && hyper.dampening == 0.0),
                "sgd: Nesterov momentum requires a momentum and zero dampening");
  // The buffer is read unless this step creates it, and written when committing.
  HEMIOLA_CHECK(numel == 0 || hyper.momentum == 0.0 || tensors.momentum ||
                    (hyper.first_step && !commit),
                "sgd: momentum != 0 needs a momentum buffer");
}

// torch.optim.Adam's argument checks, and the buffers this step needs.
void check_adam(const AdamTensors& tensors, std::int64_t numel, DType dtype,
                const AdamHyper& hyper) {
  check_common(tensors.param, tensors.shadow, tensors.grad, numel, dtype);
  HEMIOLA_CHECK(hyper.lr >= 0.0, "adam: invalid learning rate ", hyper.lr);
  HEMIOLA_CHECK(hyper.eps >= 0.0, "adam: invalid epsilon ", hyper.eps);
  HEMIOLA_CHECK(hyper.beta1 >= 0.0 && hyper.beta1 < 1.0, "adam: invalid beta1 ", hyper.beta1);
  HEMIOLA_CHECK(hyper.beta2 >= 0.0 && hyper.beta2 < 1.0, "adam: invalid beta2 ", hyper.beta2);
  HEMIOLA_CHECK(hyper.weight_decay >= 0.0, "adam: invalid weight_decay ", hyper.weight_decay);
  HEMIOLA_CHECK(hyper.step >= 1, "adam: steps count from 1, got ", hyper.step);
  HEMIOLA_CHECK(numel == 0 || (tensors.exp_avg && tensors.exp_avg_sq),
                "adam: null moment buffers");
  HEMIOLA_CHECK(numel == 0 || !hyper.amsgrad || tensors.max_exp_avg_sq,
                "adam: amsgrad needs a max_exp_avg_sq buffer");
}

// A coefficient in device memory is a GPU step's (the CPU cannot read it).
void check_host_scale(const double* grad_scale_device) {
  HEMIOLA_CHECK(grad_scale_device == nullptr,
                "optimizer step: a device-side gradient scale on a CPU tensor");
}

}  // namespace

void sgd_step(const SgdTensors& tensors, std::int64_t numel, DType dtype, const Device& device,
              const SgdHyper& hyper, bool commit, StreamRef stream) {
  check_sgd(tensors, numel, dtype, hyper, commit);
  if (numel == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::sgd_step(tensors, numel, dtype, hyper, commit, stream.handle);
  } else {
    check_host_scale(hyper.grad_scale_device);
    optim::cpu_sgd_step(tensors, numel, dtype, hyper, commit);
  }
}

void adam_step(const AdamTensors& tensors, std::int64_t numel, DType dtype, const Device& device,
               const AdamHyper& hyper, bool commit, StreamRef stream) {
  check_adam(tensors, numel, dtype, hyper);
  if (numel == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::adam_step(tensors, numel, dtype, hyper, commit, stream.handle);
  } else {
    check_host_scale(hyper.grad_scale_device);
    optim::cpu_adam_step(tensors, numel, dtype, hyper, commit);
  }
}

void sgd_steps(const std::vector<SgdStep>& steps, const Device& device, bool commit,
               StreamRef stream) {
  for (const SgdStep& s : steps) check_sgd(s.tensors, s.numel, s.dtype, s.hyper, commit);
  if (device.type == DeviceType::kCUDA) {
    cuda::sgd_steps(steps.data(), steps.size(), commit, stream.handle);
    return;
  }
  for (const SgdStep& s : steps) check_host_scale(s.hyper.grad_scale_device);
  for (const SgdStep& s : steps) {
    if (s.numel > 0) optim::cpu_sgd_step(s.tensors, s.numel, s.dtype, s.hyper, commit);
  }
}

void adam_steps(const std::vector<AdamStep>& steps, const Device& device, bool commit,
                StreamRef stream) {
  for (const AdamStep& s : steps) check_adam(s.tensors, s.numel, s.dtype, s.hyper);
  if (device.type == DeviceType::kCUDA) {
    cuda::adam_steps(steps.data(), steps.size(), commit, stream.handle);
    return;
  }
  for (const AdamStep& s : steps) check_host_scale(s.hyper.grad_scale_device);
  for (const AdamStep& s : steps) {
    if (s.numel > 0) optim::cpu_adam_step(s.tensors, s.numel, s.dtype, s.hyper, commit);
  }
}

}  // namespace hemiola
