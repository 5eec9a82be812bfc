// The streaming schedule (hemiola/streamer.h): fragments sent by step count,
// averaged by the fragment averager on a wire of their own, and landed with the outer optimizer's step and
// the merge.
#include "engine/streaming/streamer_impl.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "core/dtype_dispatch.h"
#include "hemiola/optimizer.h"
#include "optim/grad_norm.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

// Element-wise arithmetic in a floating dtype (core/dtype_dispatch.h):
// computed in double and rounded to the dtype once per result (through its
// compute type: float for float32 and the half types). For these sums of two
// values of the dtype that is what torch's ops on tensors of that dtype give:
// the double result is exact for the half types, and rounds as float's own
// arithmetic would for float32.
template <typename E>
double wide(const void* p, size_t i) {
  return static_cast<double>(E::at(p, i));
}
template <typename E>
void narrow(void* p, size_t i, double v) {
  E::put(p, i, static_cast<typename E::Compute>(v));
}

// out = a - b.
void subtract(DType dtype, void* out, const void* a, const void* b, size_t n) {
  for_floating(
      dtype,
      [&](auto e) {
        using E = decltype(e);
        for (size_t i = 0; i < n; ++i) narrow<E>(out, i, wide<E>(a, i) - wide<E>(b, i));
      },
      "streaming: not a floating dtype");
}

// live = shared + (live - base), with the difference rounded first, as
// torch's `shared + (live - base)` does.
void merge(DType dtype, void* live, const void* shared, const void* base, size_t n) {
  for_floating(
      dtype,
      [&](auto e) {
        using E = decltype(e);
        for (size_t i = 0; i < n; ++i) {
          narrow<E>(live, i, wide<E>(live, i) - wide<E>(base, i));
          narrow<E>(live, i, wide<E>(shared, i) + wide<E>(live, i));
        }
      },
      "streaming: not a floating dtype");
}

// live = lerp(shared, live, a) = shared + a * (live - shared), as torch's
// `shared.lerp_(live, a)` computes it (torchft's merge): in the compute
// type, from whichever end is nearer the weight, rounded to the dtype once.
void mix(DType dtype, void* live, const void* shared, double a, size_t n) {
  for_floating(
      dtype,
      [&](auto e) {
        using E = decltype(e);
        using T = typename E::Compute;
        const T w = static_cast<T>(a);
        for (size_t i = 0; i < n; ++i) {
          const T start = E::at(shared, i);
          const T end = E::at(live, i);
          const T diff = end - start;
          E::put(live, i, std::abs(w) < T(0.5) ? start + w * diff : end - diff * (T(1) - w));
        }
      },
      "streaming: not a floating dtype");
}

}  // namespace

StreamerImpl::StreamerImpl(Scheduler& scheduler, std::vector<StreamedParameter> params,
                           const StreamerOptions& options, Scheduler* group)
    : scheduler_(&scheduler), group_(group), params_(std::move(params)), options_(options) {
  HEMIOLA_CHECK(!params_.empty(), "streaming needs at least one parameter");
  HEMIOLA_CHECK(options_.sync_every >= 1, "streaming: sync_every must be at least 1");
  HEMIOLA_CHECK(options_.fragments >= 1 && options_.fragments <= options_.sync_every,
                "streaming: fragments must be between 1 and sync_every (", options_.sync_every,
                "), got ", options_.fragments);
  HEMIOLA_CHECK(options_.mix < 0.0 || options_.mix <= 1.0, "streaming: mix must be in [0, 1] "
                "(or negative for the eager merge), got ", options_.mix);
  HEMIOLA_CHECK(options_.overlap * options_.fragments < options_.sync_every,
                "streaming: overlap (", options_.overlap, ") must be less than sync_every / "
                "fragments (", options_.sync_every, " / ", options_.fragments,
                ") so that one fragment is on the wire at a time; lower overlap or fragments");
  size_t total = 0;
  for (const auto& p : params_) {
    HEMIOLA_CHECK(p.param.device.type == DeviceType::kCPU, "streaming: parameter '", p.name,
                  "' is on a GPU; the streamer reads host memory (hemiola.wrap gives it a host "
                  "copy of a GPU model's parameters)");
    HEMIOLA_CHECK(is_floating(p.param.dtype), "streaming: parameter '", p.name, "' has dtype ",
                  dtype_name(p.param.dtype), ", not a floating dtype");
    HEMIOLA_CHECK(p.param.numel == 0 || p.param.data != nullptr, "streaming: parameter '",
                  p.name, "' has a null data pointer");
    specs_.push_back(GradSpec{p.param.dtype, p.param.numel, p.name, 0});
    total += p.param.nbytes();
  }
  // Fragments are buckets of about 1/fragments of the model each, large
  // tensors cut so that they balance; registration order, so fragment 0
  // holds the first layers.
  const size_t cap = std::max<size_t>(1, (total + options_.fragments - 1) / options_.fragments);
  std::vector<size_t> order(specs_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  plan_ = plan_buckets(specs_, order, cap, cap, options_.fragments > 1 ? cap : 0);
  placement_ = place_pieces(plan_, specs_.size());
  size_t largest = 1;
  for (const auto& bucket : plan_) {
    Fragment fragment;
    fragment.shared.reset(new unsigned char[std::max<size_t>(bucket.nbytes(), 1)]());
    fragment.momentum.reset(new unsigned char[std::max<size_t>(bucket.nbytes(), 1)]());
    fragments_.push_back(std::move(fragment));
    largest = std::max(largest, bucket.nbytes());
  }
  for (size_t f = 0; f < plan_.size(); ++f) pack(f, fragments_[f].shared.get());
  base_.reset(new unsigned char[largest]());
  average_.reset(new unsigned char[largest]());
  averager_ = make_averager(*scheduler_);
}

std::unique_ptr<FragmentAverager> StreamerImpl::make_averager(Scheduler& scheduler) const {
  return std::make_unique<FragmentAverager>(scheduler, BucketLayout{plan_, placement_, specs_},
                                            options_.compression, group_, options_.confirm);
}

StreamerImpl::~StreamerImpl() {
  // The averager's work averages in its buffer with its codec: never let it
  // outlive the averager.
  if (handle_.valid()) handle_.wait_for(std::chrono::hours(1));
}

bool StreamerImpl::due(size_t f, uint64_t step) const {
  const uint64_t every = options_.sync_every;
  const uint64_t offset = ((f + 1) * every / plan_.size()) % every;
  return step % every == offset;
}

void StreamerImpl::pack(size_t f, unsigned char* out) const {
  const PlannedBucket& bucket = plan_[f];
  const size_t elem = dtype_size(bucket.dtype);
  for (size_t k = 0; k < bucket.tensors.size(); ++k) {
    const auto* live = static_cast<const unsigned char*>(params_[bucket.tensors[k]].param.data);
    std::memcpy(out + bucket.offsets[k] * elem, live + bucket.begins[k] * elem,
                bucket.counts[k] * elem);
  }
}

void StreamerImpl::unpack(size_t f, const unsigned char* in) {
  const PlannedBucket& bucket = plan_[f];
  const size_t elem = dtype_size(bucket.dtype);
  for (size_t k = 0; k < bucket.tensors.size(); ++k) {
    auto* live = static_cast<unsigned char*>(params_[bucket.tensors[k]].param.data);
    std::memcpy(live + bucket.begins[k] * elem, in + bucket.offsets[k] * elem,
                bucket.counts[k] * elem);
  }
}

void StreamerImpl::after_inner_step() {
  const auto start = std::chrono::steady_clock::now();
  const double waited_before = waited_ms_;
  HEMIOLA_CHECK(step_finished_, "streaming: inner step ", steps_, " did not finish (a replica "
                "failed during it); rejoin() and finish_step() before the next step");
  ++steps_;
  step_finished_ = false;
  finish_step();
  // The sync's cost on the training thread: packing, subtracting, the outer
  // step and the merge (the waits for the wire are waited_ms).
  host_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                        start).count() -
              (waited_ms_ - waited_before);
}

void StreamerImpl::finish_step() {
  // Re-entrant: after a throw (a replica failed) and a rejoin(), what was
  // done at this step is not done again (a fragment landed is no longer in
  // flight; one sent at this step has sent_step_ == steps_).
  const uint64_t step = steps_;
  if (in_flight_ && step >= sent_step_ + options_.overlap) land();
  for (size_t f = 0; f < plan_.size(); ++f) {
    if (!due(f, step) || (sent_ == f && sent_step_ == step)) continue;
    HEMIOLA_CHECK(!in_flight_, "internal: a fragment was sent while another is in flight");
    send(f);
    if (options_.overlap == 0) land();
  }
  step_finished_ = true;
}

void StreamerImpl::rejoin(Scheduler& across, bool redo) {
  if (in_flight_) {
    // Its handle is done (it failed), or is waited for here: nothing runs
    // on the old wire after this.
    bool have_average = averaged_;
    if (!averaged_) {
      try {
        handle_.wait();
        have_average = averager_->group_failure().empty() ||
                       averager_->averaged_before_failure();
      } catch (const std::exception&) {
        have_average = averager_->averaged_before_failure();
      }
    }
    if (redo) {
      averaged_ = false;  // averaged again below, from the values it was sent from
    } else {
      HEMIOLA_CHECK(have_average, "streaming: rejoin() was told to keep the average of "
                    "fragment ", sent_, ", which this rank does not have");
      if (!averaged_) {
        std::memcpy(average_.get(), averager_->averaged(sent_), plan_[sent_].nbytes());
        averaged_ = true;
      }
    }
  }
  handle_ = Handle();
  averager_ = make_averager(across);
  scheduler_ = &across;
  if (in_flight_ && !averaged_) submit_in_flight();
}

void StreamerImpl::adopt(uint64_t inner_steps, uint64_t syncs,
                         const std::vector<uint8_t>& momentum_started) {
  HEMIOLA_CHECK(!in_flight_, "streaming: adopt() with a fragment in flight");
  HEMIOLA_CHECK(momentum_started.size() == fragments_.size(), "streaming: adopt() got ",
                momentum_started.size(), " momentum flags for ", fragments_.size(),
                " fragments");
  steps_ = inner_steps;
  syncs_ = syncs;
  for (size_t f = 0; f < fragments_.size(); ++f) {
    fragments_[f].momentum_started = momentum_started[f] != 0;
    unpack(f, fragments_[f].shared.get());
  }
}

std::vector<size_t> StreamerImpl::next_step_fragments() const {
  // The same decisions after_inner_step() will take for step steps_ + 1.
  const uint64_t step = steps_ + 1;
  std::vector<size_t> out;
  if (in_flight_ && step >= sent_step_ + options_.overlap) out.push_back(sent_);
  for (size_t f = 0; f < plan_.size(); ++f) {
    if (due(f, step) && std::find(out.begin(), out.end(), f) == out.end()) out.push_back(f);
  }
  return out;
}

void StreamerImpl::send(size_t f) {
  pack(f, base_.get());
  in_flight_ = true;
  averaged_ = false;
  sent_ = f;
  sent_step_ = steps_;
  submit_in_flight();
}

void StreamerImpl::submit_in_flight() {
  const PlannedBucket& bucket = plan_[sent_];
  handle_ = averager_->average(sent_, syncs_, [&](unsigned char* pseudo_gradient) {
    subtract(bucket.dtype, pseudo_gradient, fragments_[sent_].shared.get(), base_.get(),
             bucket.numel);
  });
}

void StreamerImpl::wait_in_flight() {
  if (!in_flight_ || averaged_) return;
  const auto start = std::chrono::steady_clock::now();
  handle_.wait();
  waited_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                          start).count();
  // In an elastic group the group's gather completes even when a piece's
  // average failed (fragment_averager.h): every rank of the group raises.
  if (!averager_->group_failure().empty()) {
    HEMIOLA_THROW(ErrorCode::kCommFailure, averager_->group_failure());
  }
  std::memcpy(average_.get(), averager_->averaged(sent_), plan_[sent_].nbytes());
  averaged_ = true;
  agreed_ = averager_->agreed();
}

void StreamerImpl::land() {
  wait_in_flight();
  const size_t f = sent_;
  const PlannedBucket& bucket = plan_[f];
  Fragment& fragment = fragments_[f];
  if (options_.check_finite) check_finite(f);
  // The outer step: shared -= lr * (Nesterov) momentum of the average, the
  // same on every rank since the averages and the state are.
  SgdHyper hyper;
  static_cast<OptimizerHyper&>(hyper) = options_.outer;
  hyper.first_step = !fragment.momentum_started;
  SgdTensors tensors{fragment.shared.get(), fragment.shared.get(), fragment.momentum.get(),
                     average_.get()};
  sgd_step(tensors, static_cast<int64_t>(bucket.numel), bucket.dtype, Device{}, hyper,
           /*commit=*/true);
  fragment.momentum_started = fragment.momentum_started || options_.outer.momentum != 0.0;
  // The merge: the progress made since the send stays on top of the new
  // shared copy (nothing was made with overlap 0: live becomes shared).
  const size_t elem = dtype_size(bucket.dtype);
  for (size_t k = 0; k < bucket.tensors.size(); ++k) {
    auto* live = static_cast<unsigned char*>(params_[bucket.tensors[k]].param.data) +
                 bucket.begins[k] * elem;
    const size_t at = bucket.offsets[k] * elem;
    if (options_.mix >= 0.0) {
      mix(bucket.dtype, live, fragment.shared.get() + at, options_.mix, bucket.counts[k]);
    } else if (options_.overlap == 0) {
      std::memcpy(live, fragment.shared.get() + at, bucket.counts[k] * elem);
    } else {
      merge(bucket.dtype, live, fragment.shared.get() + at, base_.get() + at, bucket.counts[k]);
    }
  }
  in_flight_ = false;
  averaged_ = false;
  ++syncs_;
}

void StreamerImpl::check_finite(size_t f) const {
  const PlannedBucket& bucket = plan_[f];
  const size_t elem = dtype_size(bucket.dtype);
  for (size_t k = 0; k < bucket.tensors.size(); ++k) {
    if (optim::all_finite(average_.get() + bucket.offsets[k] * elem,
                          static_cast<int64_t>(bucket.counts[k]), bucket.dtype)) {
      continue;
    }
    HEMIOLA_THROW(ErrorCode::kNotFinite, "streaming: the average of fragment ", f,
                  " holds NaN or infinity in parameter '", params_[bucket.tensors[k]].name,
                  "' (sync ", syncs_ + 1, ", after inner step ", steps_,
                  "; check_finite=True); it was not applied, and every rank stops here alike. "
                  "Some replica's parameters diverged since the last sync: lower the inner "
                  "learning rate, check the inputs, or scale fp16 losses with a GradScaler.");
  }
}

TensorRef StreamerImpl::buffer(size_t f, unsigned char* data) const {
  return TensorRef{data, plan_[f].dtype, plan_[f].numel, Device{}};
}

TensorRef StreamerImpl::shared(size_t f) {
  HEMIOLA_CHECK(f < plan_.size(), "fragment ", f, " is out of range");
  return buffer(f, fragments_[f].shared.get());
}

TensorRef StreamerImpl::outer_momentum(size_t f) {
  HEMIOLA_CHECK(f < plan_.size(), "fragment ", f, " is out of range");
  return buffer(f, fragments_[f].momentum.get());
}

TensorRef StreamerImpl::residual(size_t index) {
  HEMIOLA_CHECK(index < specs_.size(), "parameter index ", index, " is out of range");
  wait_in_flight();
  std::vector<float>& r = averager_->residual(index);
  return TensorRef{r.data(), DType::kFloat32, r.size(), Device{}};
}

TensorRef StreamerImpl::in_flight_average() {
  if (!in_flight_) return TensorRef{};
  wait_in_flight();
  return buffer(sent_, average_.get());
}

TensorRef StreamerImpl::in_flight_base() {
  return in_flight_ ? buffer(sent_, base_.get()) : TensorRef{};
}

void StreamerImpl::restore(uint64_t inner_steps, const std::vector<uint8_t>& momentum_started,
                           int64_t in_flight_fragment, uint64_t in_flight_step) {
  HEMIOLA_CHECK(momentum_started.size() == fragments_.size(), "streaming: the checkpoint has ",
                momentum_started.size(), " fragments, this model ", fragments_.size(),
                " (was it saved with the same fragments?)");
  HEMIOLA_CHECK(in_flight_fragment < static_cast<int64_t>(fragments_.size()),
                "streaming: the checkpoint's fragment in flight is out of range");
  wait_in_flight();
  steps_ = inner_steps;
  for (size_t f = 0; f < fragments_.size(); ++f) {
    fragments_[f].momentum_started = momentum_started[f] != 0;
  }
  in_flight_ = in_flight_fragment >= 0;
  // Its average and base were written through in_flight_average/base.
  averaged_ = in_flight_;
  sent_ = in_flight_ ? static_cast<size_t>(in_flight_fragment) : 0;
  sent_step_ = in_flight_step;
}

std::vector<uint8_t> StreamerImpl::momentum_started() const {
  std::vector<uint8_t> out;
  for (const auto& fragment : fragments_) out.push_back(fragment.momentum_started ? 1 : 0);
  return out;
}

std::vector<std::vector<size_t>> StreamerImpl::fragments() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : plan_) {
    std::vector<size_t> tensors;
    for (size_t t : bucket.tensors) {
      if (tensors.empty() || tensors.back() != t) tensors.push_back(t);
    }
    out.push_back(std::move(tensors));
  }
  return out;
}

// ---- public facade ---------------------------------------------------------

Streamer::Streamer(std::unique_ptr<StreamerImpl> impl) : impl_(std::move(impl)) {}
Streamer::~Streamer() = default;
void Streamer::after_inner_step() { impl_->after_inner_step(); }
void Streamer::finish_step() { impl_->finish_step(); }
bool Streamer::in_flight_averaged() const { return impl_->in_flight_averaged(); }
uint64_t Streamer::in_flight_round() const { return impl_->in_flight_round(); }
void Streamer::adopt(uint64_t inner_steps, uint64_t syncs,
                     const std::vector<uint8_t>& momentum_started) {
  impl_->adopt(inner_steps, syncs, momentum_started);
}
void Streamer::offer(uint64_t epoch) { impl_->offer(epoch); }
uint64_t Streamer::agreed_offer() const { return impl_->agreed_offer(); }
std::vector<size_t> Streamer::next_step_fragments() const {
  return impl_->next_step_fragments();
}
uint64_t Streamer::inner_steps() const { return impl_->inner_steps(); }
void Streamer::wait_in_flight() { impl_->wait_in_flight(); }
double Streamer::waited_ms() const { return impl_->waited_ms(); }
double Streamer::host_ms() const { return impl_->host_ms(); }
uint64_t Streamer::syncs() const { return impl_->syncs(); }
TensorRef Streamer::shared(size_t fragment) { return impl_->shared(fragment); }
TensorRef Streamer::outer_momentum(size_t fragment) { return impl_->outer_momentum(fragment); }
TensorRef Streamer::residual(size_t index) { return impl_->residual(index); }
int64_t Streamer::in_flight_fragment() const { return impl_->in_flight_fragment(); }
uint64_t Streamer::in_flight_step() const { return impl_->in_flight_step(); }
TensorRef Streamer::in_flight_average() { return impl_->in_flight_average(); }
TensorRef Streamer::in_flight_base() { return impl_->in_flight_base(); }
void Streamer::restore(uint64_t inner_steps, const std::vector<uint8_t>& momentum_started,
                       int64_t in_flight_fragment, uint64_t in_flight_step) {
  impl_->restore(inner_steps, momentum_started, in_flight_fragment, in_flight_step);
}
std::vector<uint8_t> Streamer::momentum_started() const { return impl_->momentum_started(); }
std::vector<std::vector<size_t>> Streamer::fragments() const { return impl_->fragments(); }
const StreamerOptions& Streamer::options() const { return impl_->options(); }

}  // namespace hemiola
