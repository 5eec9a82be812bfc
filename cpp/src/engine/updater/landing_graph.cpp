// engine/updater/landing_graph.h: the bookkeeping of pending iterations and the
// exact step that lands one on a parameter (skipping unused parameters,
// scaled by the global scale, optim/global_scale.h).
#include "engine/updater/landing_graph.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "hemiola/optimizer.h"
#include "hemiola/reducer.h"
#include "hemiola/status.h"
#include "optim/global_scale.h"
#include "optim/grad_norm.h"

namespace hemiola {

LandingGraph::LandingGraph(Engine& engine, Reducer& reducer, const UpdaterOptions& options,
                           StreamRef stream)
    : engine_(engine), reducer_(reducer), reduction_(reducer.reduction_results()),
      previews_(reducer.preview_results()), options_(options),
      device_(reducer.options().device), in_flight_(reducer.options().in_flight),
      stream_(stream), timeline_(engine.options().timeline), rebuilt_(!options.rebuild_buckets),
      gathered_(in_flight_ + 1), stepper_(make_stepper(device_, options)) {}

// ---- parameters and gates ---------------------------------------------------------

void LandingGraph::adopt(std::vector<ParameterSlot> params) {
  for (const auto& p : params) {
    HEMIOLA_CHECK(p.param.device.type == device_.type &&
                      (device_.type == DeviceType::kCPU || p.param.device.index == device_.index),
                  "updater: parameter '", p.name, "' is not on the reducer's device");
    if (device_.type == DeviceType::kCUDA && p.param.numel > 0) {
      HEMIOLA_CHECK(cuda::device_of(p.param.data) == device_.index, "updater: parameter '",
                    p.name, "' does not point to memory of CUDA device ", device_.index);
    }
    HEMIOLA_CHECK(is_floating(p.param.dtype), "updater: parameter '", p.name,
                  "' has dtype ", dtype_name(p.param.dtype), ", not a floating dtype");
    HEMIOLA_CHECK(p.param.numel == 0 || p.param.data, "updater: parameter '", p.name,
                  "' has no data");
    if (!options_.external && options_.optimizer != OptimizerKind::kSgd) {
      HEMIOLA_CHECK(p.param.numel == 0 || (p.exp_avg && p.exp_avg_sq && p.step),
                    "updater: Adam parameter '", p.name, "' lacks exp_avg, exp_avg_sq or step");
    }
  }
  params_ = std::move(params);
  const size_t n = params_.size();
  exact_.resize(n);
  for (size_t i = 0; i < n; ++i) exact_[i] = params_[i].param.data;
  groups_ = 0;
  for (const auto& p : params_) groups_ = std::max(groups_, p.group + 1);
  all_.resize(n);
  for (size_t i = 0; i < n; ++i) all_[i] = i;
  if (gates_.empty()) {
    gates_ = {all_};
  } else {
    gates_[0] = all_;
  }
  local_grads_.assign(n, nullptr);
  read_.assign(n, 0);
  device_clip_.reset();
  if (options_.device_clip_norms && device_.type == DeviceType::kCUDA && !options_.external) {
    std::vector<DType> dtypes(n);
    for (size_t i = 0; i < n; ++i) dtypes[i] = params_[i].param.dtype;
    device_clip_ = std::make_unique<DeviceClip>(device_.index, dtypes);
  }
}

void LandingGraph::set_gates(std::vector<std::vector<size_t>> gates) {
  HEMIOLA_CHECK(!gates.empty() && gates[0] == all_,
                "updater: gate 0 must be every parameter");
  for (const auto& gate : gates) {
    for (size_t i : gate) {
      HEMIOLA_CHECK(i < params_.size(), "updater: gate names parameter ", i, " of ",
                    params_.size());
    }
  }
  gates_ = std::move(gates);
}

const std::vector<size_t>& LandingGraph::gate(size_t l) const {
  HEMIOLA_CHECK(l < gates_.size(), "updater: gate ", l, " of ", gates_.size());
  return gates_[l];
}

void LandingGraph::check_index(size_t index) const {
  HEMIOLA_CHECK(index < params_.size(), "updater: parameter ", index, " of ", params_.size());
}

void LandingGraph::check_hyper(const StepOptions& options) const {
  if (options_.external) return;  // its hyper-parameters are the caller's
  HEMIOLA_CHECK(groups_ <= options.hyper.size(), "updater: the parameters are in ", groups_,
                " groups but the step has hyper-parameters for ", options.hyper.size());
}

// ---- the reducer's plan ---------------------------------------------------------------

void LandingGraph::refresh_buckets() {
  const auto buckets = reducer_.buckets();
  buckets_of_.assign(params_.size(), {});
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (size_t i : buckets[b]) {
      HEMIOLA_CHECK(i < params_.size(), "updater: the reducer has more gradients (", i + 1,
                    ") than parameters (", params_.size(), ")");
      buckets_of_[i].push_back(b);
    }
  }
  partitioned_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) partitioned_[i] = reducer_.pieces(i) > 1;
  bucket_bytes_.assign(buckets.size(), 0.0);
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (size_t i : buckets[b]) {
      bucket_bytes_[b] += static_cast<double>(params_[i].param.nbytes()) / buckets_of_[i].size();
    }
  }
}

void LandingGraph::rebuild_buckets() {
  drain();
  reducer_.rebuild_from_observed_order();
  refresh_buckets();
  rebuilt_ = true;
}

// A partitioned gradient lives in several buckets; results that must outlive
// a rebuild are kept too. Both go to the updater's own buffers.
bool LandingGraph::gathers(size_t index) const {
  return partitioned_[index] || (!rebuilt_ && gather_until_rebuilt_);
}

// The ring has checked mark.index against its gradients, which are this
// graph's parameters (refresh_buckets).
void LandingGraph::on_mark(Mark& mark) {
  use_stream(StreamRef{mark.stream});
  if (!gathers(mark.index)) return;
  auto& buffer = gathered_[mark.iteration % gathered_.size()];
  if (buffer.size() != params_.size()) buffer.resize(params_.size());
  mark.out = buffer[mark.index].reserve(device_, params_[mark.index].param.nbytes());
}

// Before step(): where on_mark() sent the reduced value when
// `iteration` was marked (the gathering cannot have changed since: buckets are
// rebuilt only in a step).
TensorRef LandingGraph::averaged(uint64_t iteration, size_t index) const {
  HEMIOLA_CHECK(index < params_.size(), "averaged: no parameter ", index);
  if (!gathers(index)) return reduction_.value(iteration, index);
  TensorRef out = params_[index].param;
  const auto& buffer = gathered_[iteration % gathered_.size()];
  HEMIOLA_CHECK(index < buffer.size() && buffer[index].data() != nullptr,
                "averaged: parameter ", index, " was not marked in iteration ", iteration);
  out.data = const_cast<void*>(buffer[index].data());
  return out;
}

const void* LandingGraph::reduced(const Pending& pending, size_t index) const {
  if (pending.gathered || partitioned_[index]) {
    return gathered_[pending.iteration % gathered_.size()][index].data();
  }
  return reduction_.value(pending.iteration, index).data;
}

// ---- one iteration's marks and reads --------------------------------------------------

void LandingGraph::clear_local_grads() {
  std::fill(local_grads_.begin(), local_grads_.end(), nullptr);
}

void LandingGraph::clear_reads() { std::fill(read_.begin(), read_.end(), 0); }

void LandingGraph::mark_read(const std::vector<size_t>& indices) {
  for (size_t i : indices) read_[i] = 1;
}

// ---- pending iterations ---------------------------------------------------------------

Pending& LandingGraph::start_pending(uint64_t iteration, const StepOptions& options) {
  Pending& pending = pending_.emplace_back();
  pending.iteration = iteration;
  pending.options = options;
  pending.applied.assign(params_.size(), 0);
  pending.remaining = all_;
  pending.bucket_arrived.assign(bucket_bytes_.size(), 0);
  return pending;
}

bool LandingGraph::arrived(Pending& pending, size_t index) const {
  if (pending.gathered) return true;
  for (size_t b : buckets_of_[index]) {
    if (!pending.bucket_arrived[b]) {
      if (!reduction_.done(pending.iteration, b)) return false;
      pending.bucket_arrived[b] = 1;
    }
  }
  return true;
}

void LandingGraph::wait_for(const Pending& pending, const std::vector<size_t>& indices) {
  if (pending.gathered) return;
  const int64_t start = now_us();
  if (pending.needs_whole()) {
    reduction_.wait_iteration(pending.iteration, stream_.handle);
    record("wait", start, "wait reduction ", pending.iteration);
    return;
  }
  reduction_.wait_for(pending.iteration, indices, stream_.handle);
  record("wait", start, "wait buckets (", pending.iteration, ")");
}

// Parameters no rank used are skipped, clipping scales the gradients by the
// coefficient of the whole averaged gradient, and a non-finite one under a
// GradScaler skips the update on every rank.
void LandingGraph::apply(Pending& pending, const std::vector<size_t>& chosen) {
  const StepOptions& o = pending.options;
  if (o.has_unused && pending.usage.empty()) pending.usage = reduction_.usage(pending.iteration);
  if ((o.clip_max_norm >= 0.0 || o.skip_if_not_finite) && !pending.scale_known) {
    // needs_whole: every bucket has arrived.
    if (device_clip_ && !o.skip_if_not_finite) {
      clip_on_device(pending);
    } else {
      scale_of(pending);
    }
  }
  if (options_.raise_if_not_finite && !o.skip_if_not_finite) {
    const std::vector<const void*> averages = readable(pending, chosen);
    for (size_t k = 0; k < chosen.size(); ++k) {
      const size_t i = chosen[k];
      if (pending.used(i) && !optim::all_finite(averages[k], params_[i].param.numel,
                                                params_[i].param.dtype)) {
        // Nothing more of the iteration (nor of a later one) is applied,
        // and the live parameters are the exact ones (a local step may
        // have taken the NaN in).
        for (const Pending& q : pending_) {
          for (size_t j : q.remaining) restore(j);
        }
        const uint64_t iteration = pending.iteration;
        pending_.clear();  // (`pending` is gone from here on)
        HEMIOLA_THROW(
            ErrorCode::kNotFinite, "hemiola: the averaged gradient of parameter '",
            params_[i].name, "' holds NaN or infinity in iteration ", iteration,
            " (check_finite=True); it was not applied. Some rank's loss diverged or "
            "overflowed: lower the learning rate, check the inputs, or scale fp16 losses "
            "with a GradScaler (grad_scaler=...).");
      }
    }
  }
  // One step of the whole group (an external stepper's is one call).
  StepGroup group;
  group.options = &pending.options;
  group.grad_scale = pending.coef;
  group.grad_scale_device = pending.coef_device;
  for (size_t i : chosen) {
    if (pending.skip || !pending.used(i)) {
      restore(i);  // decoupled: drop the approximate step
    } else {
      group.indices.push_back(i);
      group.grads.push_back(reduced(pending, i));
    }
    pending.applied[i] = 1;
  }
  commit(group);
  auto& remaining = pending.remaining;
  remaining.erase(std::remove_if(remaining.begin(), remaining.end(),
                                 [&](size_t i) { return pending.applied[i] != 0; }),
                  remaining.end());
}

// The GradScaler skip (any averaged gradient not finite) and the clipping
// coefficient of `pending`, over the averaged gradients of the parameters
// some rank used.
void LandingGraph::scale_of(Pending& pending) {
  const StepOptions& o = pending.options;
  std::vector<size_t> counted;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (pending.used(i)) counted.push_back(i);
  }
  const std::vector<const void*> averages = readable(pending, counted);
  std::vector<optim::HostGrad> grads(counted.size());
  for (size_t k = 0; k < counted.size(); ++k) {
    const TensorRef& t = params_[counted[k]].param;
    grads[k] = {averages[k], static_cast<std::int64_t>(t.numel), t.dtype};
  }
  std::optional<double> total;
  if (o.clip_max_norm >= 0.0 && options_.clip_norm && device_.type == DeviceType::kCPU) {
    std::vector<TensorRef> refs(counted.size());
    for (size_t k = 0; k < counted.size(); ++k) {
      refs[k] = params_[counted[k]].param;
      refs[k].data = const_cast<void*>(averages[k]);
    }
    total = options_.clip_norm(counted, refs, o.clip_norm_type);
  }
  const optim::GlobalScale scale =
      optim::global_scale(grads, o.clip_max_norm, o.clip_norm_type, o.skip_if_not_finite,
                          total ? &*total : nullptr);
  pending.skip = scale.skip;
  if (o.clip_max_norm >= 0.0) {
    pending.coef = scale.coef;
    clip_norms_.emplace_back(pending.iteration, scale.total_norm);
    if (clip_norms_.size() > 16) clip_norms_.pop_front();
  }
  pending.scale_known = true;
}

// scale_of's clipping coefficient computed on the GPU: the host does not
// wait for the reduction, and the steps read the coefficient where it is. A
// parameter no rank used has a zero average, which adds nothing to the norm.
void LandingGraph::clip_on_device(Pending& pending) {
  const StepOptions& o = pending.options;
  std::vector<cuda::NormInput> inputs(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const TensorRef& t = params_[i].param;
    inputs[i] = {reduced(pending, i), static_cast<std::int64_t>(t.numel), t.dtype};
  }
  pending.coef_device = device_clip_->compute(pending.iteration, inputs, o.clip_norm_type,
                                              o.clip_max_norm, stream_.handle);
  pending.scale_known = true;
}

void LandingGraph::restore(size_t i) {
  const auto& p = params_[i].param;
  if (exact_[i] != p.data) copy(p.data, exact_[i], p.nbytes());
}

void LandingGraph::resolve(StepGroup& group) {
  group.params.resize(group.indices.size());
  group.exact.resize(group.indices.size());
  for (size_t k = 0; k < group.indices.size(); ++k) {
    group.params[k] = &params_[group.indices[k]];
    group.exact[k] = exact_[group.indices[k]];
  }
}

void LandingGraph::commit(StepGroup& group) {
  resolve(group);
  stepper_->commit(group, stream_);
}

void LandingGraph::local(std::vector<StepGroup>& chain) {
  for (StepGroup& link : chain) resolve(link);
  stepper_->local(chain, stream_);
}

std::optional<double> LandingGraph::clip_norm(uint64_t iteration) const {
  for (const auto& [it, norm] : clip_norms_) {
    if (it == iteration) return norm;
  }
  if (device_clip_) return device_clip_->total_norm(iteration);
  return std::nullopt;
}

// The averaged gradients of `indices` where the host can read them: on the
// CPU the reduced values themselves; on a GPU copies in host memory, made
// after the stream's waits for them (one synchronisation for all).
std::vector<const void*> LandingGraph::readable(const Pending& pending,
                                                const std::vector<size_t>& indices) {
  std::vector<const void*> out;
  out.reserve(indices.size());
  if (device_.type == DeviceType::kCPU) {
    for (size_t i : indices) out.push_back(reduced(pending, i));
    return out;
  }
  if (staging_.size() < indices.size()) staging_.resize(indices.size());
  for (size_t k = 0; k < indices.size(); ++k) {
    const size_t bytes = params_[indices[k]].param.nbytes();
    void* host = allocate(staging_[k], bytes);
    if (bytes > 0) cuda::copy_async(host, reduced(pending, indices[k]), bytes, stream_.handle);
    out.push_back(host);
  }
  cuda::synchronize(stream_.handle);
  return out;
}

// ---- device and stream -------------------------------------------------------------------

// The stream of the call that begins. On a GPU everything the updater
// enqueues stays in one order, whatever streams the calls come on: a new
// stream first waits for the work enqueued on the previous one (so a kernel
// never reads a reducer buffer that a later iteration's copy-in, ordered
// after the marks' stream, may overwrite).
void LandingGraph::use_stream(StreamRef stream) {
  if (device_.type == DeviceType::kCUDA && stream.handle != stream_.handle) {
    if (!switched_) switched_ = std::make_unique<cuda::Event>(device_.index);
    switched_->record(stream_.handle);
    switched_->block(stream.handle);
  }
  stream_ = stream;
}

void LandingGraph::drain() {
  if (device_.type == DeviceType::kCUDA) cuda::synchronize(stream_.handle);
}

void LandingGraph::copy(void* dst, const void* src, size_t bytes) const {
  copy_on(device_, stream_, dst, src, bytes);
}

}  // namespace hemiola
