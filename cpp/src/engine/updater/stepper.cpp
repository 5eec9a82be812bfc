// engine/updater/stepper.h: the engine's SGD / Adam / AdamW steps of a landing group,
// and the caller's external step.
#include "engine/updater/stepper.h"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/updater/device_memory.h"
#include "hemiola/optimizer.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

// Scratch of a local chain longer than one step: a parameter and its
// optimizer state stepped through several pending iterations. One set, grown
// to the largest tensor, serves every parameter in turn (on a GPU the steps
// are ordered on one stream).
struct Scratch {
  Buffer param, momentum, exp_avg, exp_avg_sq, max_exp_avg_sq;
  float step = 0.0f;
};

class NativeStepper final : public Stepper {
 public:
  NativeStepper(const Device& device, const UpdaterOptions& options)
      : device_(device),
        optimizer_(options.optimizer),
        sqrt_(options.sqrt),
        multi_tensor_(options.multi_tensor_steps) {}

  void commit(const StepGroup& group, StreamRef stream) override {
    stream_ = stream;
    step_group(group, /*commit=*/true);
  }

  void local(const std::vector<StepGroup>& chain, StreamRef stream) override {
    if (chain.empty()) return;
    stream_ = stream;
    if (chain.size() == 1) {
      step_group(chain[0], /*commit=*/false);
      return;
    }
    for (size_t k = 0; k < chain[0].indices.size(); ++k) local_chain(chain, k);
  }

 private:
  // Each parameter of `group` one step from its exact value.
  void step_group(const StepGroup& group, bool commit) {
    if (multi_tensor_) {
      step_together(group, commit);
      return;
    }
    for (size_t k = 0; k < group.indices.size(); ++k) {
      step(*group.params[k], group.exact[k], group.grads[k], *group.options, group.grad_scale,
           commit, group.grad_scale_device);
    }
  }

  // Parameter chain[*].params[k] through the whole chain: copies of the
  // exact value and the state take every step but the last committed, so
  // that each step reads the state the previous one left; the last step goes
  // from the copies into the live parameter.
  void local_chain(const std::vector<StepGroup>& chain, size_t k) {
    ParameterSlot slot = *chain[0].params[k];
    const size_t bytes = slot.param.nbytes();
    void* live = slot.param.data;
    void* value = scratch_.param.reserve(device_, bytes);
    copy_on(device_, stream_, value, chain[0].exact[k], bytes);
    auto copy_state = [&](Buffer& buffer, void*& state) {
      if (!state) return;
      void* copied = buffer.reserve(device_, bytes);
      copy_on(device_, stream_, copied, state, bytes);
      state = copied;
    };
    copy_state(scratch_.momentum, slot.momentum_buffer);
    copy_state(scratch_.exp_avg, slot.exp_avg);
    copy_state(scratch_.exp_avg_sq, slot.exp_avg_sq);
    copy_state(scratch_.max_exp_avg_sq, slot.max_exp_avg_sq);
    if (slot.step) {
      scratch_.step = *slot.step;
      slot.step = &scratch_.step;
    }
    for (size_t link = 0; link < chain.size(); ++link) {
      const bool last = link + 1 == chain.size();
      // Committing into the scratch (live and exact the same memory), and
      // the last step from it into the live parameter.
      slot.param.data = last ? live : value;
      step(slot, value, chain[link].grads[k], *chain[link].options, chain[link].grad_scale,
           /*commit=*/!last);
    }
  }

  // One step of `p` from `exact` into p.param; committing also advances
  // `exact` and the state (hemiola/optimizer.h).
  void step(ParameterSlot& p, void* exact, const void* grad, const StepOptions& options,
            double grad_scale, bool commit, const double* grad_scale_device = nullptr) {
    const auto numel = static_cast<std::int64_t>(p.param.numel);
    if (optimizer_ == OptimizerKind::kSgd) {
      sgd_step(SgdTensors{p.param.data, exact, p.momentum_buffer, grad}, numel, p.param.dtype,
               device_, sgd_hyper(p, options, grad_scale, grad_scale_device), commit, stream_);
    } else {
      adam_step(AdamTensors{p.param.data, exact, p.exp_avg, p.exp_avg_sq, grad, p.max_exp_avg_sq},
                numel, p.param.dtype, device_,
                adam_hyper(p, options, grad_scale, grad_scale_device), commit, stream_);
    }
    if (commit) advance(p, options);
  }

  // step() for every parameter of `group`, in multi-tensor calls.
  void step_together(const StepGroup& group, bool commit) {
    const size_t n = group.indices.size();
    if (optimizer_ == OptimizerKind::kSgd) {
      sgd_batch_.resize(n);
      for (size_t k = 0; k < n; ++k) {
        ParameterSlot& p = *group.params[k];
        sgd_batch_[k] = SgdStep{
            SgdTensors{p.param.data, group.exact[k], p.momentum_buffer, group.grads[k]},
            static_cast<std::int64_t>(p.param.numel), p.param.dtype,
            sgd_hyper(p, *group.options, group.grad_scale, group.grad_scale_device)};
      }
      sgd_steps(sgd_batch_, device_, commit, stream_);
    } else {
      adam_batch_.resize(n);
      for (size_t k = 0; k < n; ++k) {
        ParameterSlot& p = *group.params[k];
        adam_batch_[k] = AdamStep{
            AdamTensors{p.param.data, group.exact[k], p.exp_avg, p.exp_avg_sq, group.grads[k],
                        p.max_exp_avg_sq},
            static_cast<std::int64_t>(p.param.numel), p.param.dtype,
            adam_hyper(p, *group.options, group.grad_scale, group.grad_scale_device)};
      }
      adam_steps(adam_batch_, device_, commit, stream_);
    }
    if (commit) {
      for (ParameterSlot* p : group.params) advance(*p, *group.options);
    }
  }

  // p's hyper-parameters for this step (hemiola/optimizer.h): its group's,
  // the first-step flag or step count from its state, and the gradient scale.
  SgdHyper sgd_hyper(const ParameterSlot& p, const StepOptions& options, double grad_scale,
                     const double* grad_scale_device) const {
    const OptimizerHyper& h = options.hyper[p.group];
    HEMIOLA_CHECK(h.momentum == 0.0 || p.momentum_buffer || p.param.numel == 0,
                  "updater: parameter '", p.name, "' has momentum ", h.momentum,
                  " but no momentum buffer (set momentum before wrapping)");
    SgdHyper s{h};
    s.first_step = h.momentum != 0.0 && !p.momentum_initialised;
    s.grad_scale = grad_scale;
    s.grad_scale_device = grad_scale_device;
    return s;
  }

  AdamHyper adam_hyper(const ParameterSlot& p, const StepOptions& options, double grad_scale,
                       const double* grad_scale_device) const {
    AdamHyper a{options.hyper[p.group]};
    a.decoupled_weight_decay = optimizer_ == OptimizerKind::kAdamW;
    a.step = static_cast<std::int64_t>(*p.step) + 1;
    a.grad_scale = grad_scale;
    a.grad_scale_device = grad_scale_device;
    a.sqrt = sqrt_;
    return a;
  }

  // The state a committed step leaves: the momentum buffer exists, or one
  // more Adam step was taken.
  void advance(ParameterSlot& p, const StepOptions& options) const {
    if (optimizer_ == OptimizerKind::kSgd) {
      if (options.hyper[p.group].momentum != 0.0) p.momentum_initialised = true;
    } else {
      *p.step += 1.0f;
    }
  }

  const Device device_;
  StreamRef stream_;   // the stream of the call in progress
  OptimizerKind optimizer_;
  VectorSqrt sqrt_;    // UpdaterOptions::sqrt
  bool multi_tensor_;  // UpdaterOptions::multi_tensor_steps
  Scratch scratch_;    // local chains longer than one step
  std::vector<SgdStep> sgd_batch_;    // scratch of step_together()
  std::vector<AdamStep> adam_batch_;  // scratch of step_together()
};

// The caller's step (UpdaterOptions::external). It steps the live parameters
// in place, so the live value is set to the exact one first, and a committed
// step's result is copied back into the exact value (both copies are nothing
// where live and exact are the same memory, as under priority).
class ExternalSteps final : public Stepper {
 public:
  ExternalSteps(const Device& device, std::shared_ptr<ExternalStepper> external)
      : device_(device), external_(std::move(external)) {}

  void commit(const StepGroup& group, StreamRef stream) override {
    if (group.indices.empty()) return;
    restore(group, stream);
    call(group, StepMode::kCommit);
    for (size_t k = 0; k < group.params.size(); ++k) {
      const TensorRef& p = group.params[k]->param;
      if (group.exact[k] != p.data) copy_on(device_, stream, group.exact[k], p.data, p.nbytes());
    }
  }

  void local(const std::vector<StepGroup>& chain, StreamRef stream) override {
    if (chain.empty() || chain[0].indices.empty()) return;
    restore(chain[0], stream);
    for (size_t link = 0; link < chain.size(); ++link) {
      call(chain[link], link == 0 ? StepMode::kLocal : StepMode::kLocalAgain);
    }
  }

 private:
  // Each live value <- its exact value (nothing where they are the same).
  void restore(const StepGroup& group, StreamRef stream) const {
    for (size_t k = 0; k < group.params.size(); ++k) {
      const TensorRef& p = group.params[k]->param;
      if (group.exact[k] != p.data) copy_on(device_, stream, p.data, group.exact[k], p.nbytes());
    }
  }

  void call(const StepGroup& group, StepMode mode) {
    HEMIOLA_CHECK(!group.grad_scale_device, "updater: a device-side clipping coefficient "
                  "reached the external stepper (device_clip_norms is the engine's steps')");
    refs_.resize(group.indices.size());
    for (size_t k = 0; k < group.indices.size(); ++k) {
      refs_[k] = group.params[k]->param;
      refs_[k].data = const_cast<void*>(group.grads[k]);  // read-only to the stepper
    }
    external_->step(group.indices, refs_, group.options->hyper_key, group.grad_scale, mode);
  }

  const Device device_;
  std::shared_ptr<ExternalStepper> external_;
  std::vector<TensorRef> refs_;  // scratch of call()
};

}  // namespace

std::unique_ptr<Stepper> make_stepper(const Device& device, const UpdaterOptions& options) {
  if (options.external) return std::make_unique<ExternalSteps>(device, options.external);
  return std::make_unique<NativeStepper>(device, options);
}

}  // namespace hemiola
