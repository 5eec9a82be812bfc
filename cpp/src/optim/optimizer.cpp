// hemiola/optimizer.h: checks the arguments as torch.optim does, then runs
// the step on the tensor's device.
#include "hemiola/optimizer.h"

#include "hemiola/status.h"
#include "kernels.h"
#include "optim/cpu_optimizer.h"

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

OptimizerKind optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown optimizer '", name,
                "': the engine steps 'sgd', 'adam' and 'adamw'");
}

void sgd_step(const SgdTensors& tensors, std::int64_t numel, DType dtype, const Device& device,
              const SgdHyper& hyper, bool commit, StreamRef stream) {
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
  if (numel == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::sgd_step(tensors, numel, dtype, hyper, commit, stream.handle);
  } else {
    optim::cpu_sgd_step(tensors, numel, dtype, hyper, commit);
  }
}

void adam_step(const AdamTensors& tensors, std::int64_t numel, DType dtype, const Device& device,
               const AdamHyper& hyper, bool commit, StreamRef stream) {
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
  if (numel == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::adam_step(tensors, numel, dtype, hyper, commit, stream.handle);
  } else {
    optim::cpu_adam_step(tensors, numel, dtype, hyper, commit);
  }
}

}  // namespace hemiola
