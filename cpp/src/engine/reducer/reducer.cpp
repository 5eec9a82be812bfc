// The reducer: its plan, ring and lanes composed (reducer_impl.h), the waits
// on the user's side, rebuilds, and the public facade.
#include "hemiola/reducer.h"

#include <algorithm>
#include <chrono>
#include <mutex>

#include "core/dtype_math.h"
#include "engine/codec/preview.h"
#include "engine/wire/device_setup.h"
#include "engine/reducer/reducer_impl.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

std::string describe_device(const Device& device) {
  return device.type == DeviceType::kCPU ? std::string("the CPU")
                                         : "CUDA device " + std::to_string(device.index);
}

std::vector<GradSpec> checked(std::vector<GradSpec> specs) {
  HEMIOLA_CHECK(!specs.empty(), "a reducer needs at least one gradient tensor");
  for (const GradSpec& spec : specs) {
    HEMIOLA_CHECK(is_floating(spec.dtype), "gradient '", spec.name, "' has dtype ",
                  dtype_name(spec.dtype),
                  "; supported gradient dtypes are float32, float64, float16 and bfloat16");
  }
  return specs;
}

}  // namespace

ReducerImpl::ReducerImpl(Scheduler& host, std::vector<GradSpec> specs,
                         const ReducerOptions& options)
    : host_(host),
      options_(options),
      plan_{checked(std::move(specs)), {}, {}, {}, 0},
      ring_(plan_, options.in_flight, options.record_order) {
  HEMIOLA_CHECK(options_.fusion_bytes > 0 && options_.first_bucket_bytes > 0,
                "fusion_bytes and first_bucket_bytes must be positive");
  if (on_device()) {
    HEMIOLA_CHECK(options_.device.index >= 0, "a CUDA reducer needs a device index, got ",
                  options_.device.index);
  }
  reduction_ = std::make_unique<ReductionLane>(ring_, plan_, host_, options_.device,
                                               options_.track_usage);
  if (options_.preview) {
    HEMIOLA_CHECK(!on_device(), "ReducerOptions::preview is implemented for CPU reducers only");
    HEMIOLA_CHECK(preview_levels(host_.options().world_size) >= 1,
                  "ReducerOptions::preview codes the sum of all ranks in one byte, which needs "
                  "at most 127 ranks (world_size is ", host_.options().world_size, ")");
    // Its wire is connected now, at wrap time, not in a backward hook of
    // the first iteration that takes a preview.
    preview_ = std::make_unique<PreviewLane>(ring_, plan_, host_, *reduction_);
    ring_.add_lane(*preview_);
    reduction_->gate_on(*preview_);
  }
  ring_.add_lane(*reduction_);
  reduction_->set_codec(make_codec(options_.compression));
  build(reverse_order(plan_.specs.size()));
  if (on_device()) {
    // The device's stream and communicator are made now, on the scheduler
    // thread (a collective, in submission order), rather than inside the
    // first iteration: NCCL's initialisation synchronises the device, and
    // its errors belong to wrap time.
    set_up_device(host_, options_.device.index);
  }
}

ReducerImpl::~ReducerImpl() {
  // Lane work refers to our flights: never let it outlive us.
  abort("reducer destroyed");
  drain(/*abort_marking=*/false);
}

std::vector<const Lane*> ReducerImpl::lanes() const {
  std::vector<const Lane*> out;
  if (preview_) out.push_back(preview_.get());
  out.push_back(reduction_.get());
  return out;
}

void ReducerImpl::drain(bool abort_marking) noexcept {
  if (abort_marking && marking()) {
    try {
      abort("the outputs of the iteration being marked were released (its updater was "
            "destroyed) before it finished");
    } catch (...) {
      ring_.abort("");  // without a reason (no memory for it)
    }
  }
  // An aborted iteration's work ends at its next look at the ready queue; a
  // running reduction ends within the engine's timeout; then the device's
  // share of it (unpacks into the outputs).
  for (const auto& flight : ring_.flights()) {
    for (const Lane* lane : lanes()) {
      const Handle& handle = lane->handle(flight->slot);
      if (handle.valid()) handle.wait_for(std::chrono::hours(1));
    }
    try {
      flight->storage->drain_device(timeout());
    } catch (...) {
      // A device that fails here has failed its work already.
    }
  }
}

std::vector<FusedBucket> plan_fusion(const std::vector<GradSpec>& specs,
                                     const std::vector<size_t>& order, size_t first_bucket_bytes,
                                     size_t fusion_bytes) {
  check_permutation(order, specs.size());
  std::vector<FusedBucket> out;
  for (const PlannedBucket& planned :
       plan_buckets(specs, order, first_bucket_bytes, fusion_bytes, /*partition_bytes=*/0)) {
    out.push_back({planned.dtype, planned.tensors, planned.offsets, planned.numel});
  }
  return out;
}

void ReducerImpl::build(const std::vector<size_t>& order) {
  plan_.buckets = plan_buckets(plan_.specs, order, options_.first_bucket_bytes,
                               options_.fusion_bytes, options_.partition_bytes);
  plan_.placement = place_pieces(plan_.buckets, plan_.specs.size());
  plan_.issue_order.resize(plan_.buckets.size());
  for (size_t b = 0; b < plan_.buckets.size(); ++b) plan_.issue_order[b] = b;
  plan_.first_iteration = ring_.started();
  ring_.build([this] { return make_storage(); });
}

std::unique_ptr<Codec> ReducerImpl::make_codec(Compression compression) const {
  return hemiola::make_codec(CodecSpec{plan_.specs, options_.device, compression,
                                       options_.average, host_.options().world_size,
                                       options_.powersgd_rank,
                                       options_.powersgd_start_iteration});
}

void ReducerImpl::set_compression(Compression compression, size_t powersgd_rank,
                                  uint64_t powersgd_start_iteration) {
  std::lock_guard<std::mutex> lock(ring_.mutex());
  HEMIOLA_CHECK(ring_.started() == 0 && !marking(),
                "set_compression after the first iteration started; set it before");
  options_.powersgd_rank = powersgd_rank;
  options_.powersgd_start_iteration = powersgd_start_iteration;
  reduction_->set_codec(make_codec(compression));
  options_.compression = compression;
  // The storages keep the codec's wire memory: make them anew (no iteration
  // has used them).
  ring_.replace_storage([this] { return make_storage(); });
}

std::unique_ptr<BucketStorage> ReducerImpl::make_storage() {
  const BucketLayout layout{plan_.buckets, plan_.placement, plan_.specs};
  if (on_device()) {
    return make_device_buckets(layout, host_.devices(), options_.device.index,
                               reduction_->codec().wire_bytes(plan_.buckets), timeout());
  }
  return make_host_buckets(layout);
}

std::chrono::milliseconds ReducerImpl::timeout() const {
  return std::chrono::milliseconds(static_cast<int64_t>(host_.options().timeout_s * 1000.0));
}

void ReducerImpl::wait(uint64_t iteration, void* stream) {
  reduction_->wait_iteration(iteration, stream);
}

void ReducerImpl::wait_for(uint64_t iteration, const std::vector<size_t>& indices,
                           void* stream) {
  reduction_->wait_for(iteration, indices, stream);
}

std::vector<size_t> ReducerImpl::arrived(uint64_t iteration,
                                         const std::vector<size_t>& indices) const {
  std::vector<int8_t> known(plan_.buckets.size(), -1);  // per bucket: unknown, not done, done
  std::vector<size_t> out;
  for (size_t i : indices) {
    HEMIOLA_CHECK(i < plan_.specs.size(), "gradient index ", i, " is out of range (",
                  plan_.specs.size(), " gradients)");
    bool all = true;
    for (const Placement& piece : plan_.placement[i]) {
      int8_t& done = known[piece.bucket];
      if (done < 0) done = reduction_->done(iteration, piece.bucket) ? 1 : 0;
      all = all && done == 1;
    }
    if (all) out.push_back(i);
  }
  return out;
}

void ReducerImpl::set_issue_order(const std::vector<size_t>& order) {
  check_permutation(order, plan_.buckets.size());
  HEMIOLA_CHECK(!marking(), "set_issue_order while gradients are being marked");
  wait_all();
  std::lock_guard<std::mutex> lock(ring_.mutex());
  plan_.issue_order = order;
}

std::vector<size_t> ReducerImpl::issue_order() const {
  std::lock_guard<std::mutex> lock(ring_.mutex());
  return plan_.issue_order;
}

void ReducerImpl::wait_all() {
  std::vector<Handle> handles;
  {
    std::lock_guard<std::mutex> lock(ring_.mutex());
    for (const auto& flight : ring_.flights()) {
      for (const Lane* lane : lanes()) {
        const Handle& handle = lane->handle(flight->slot);
        if (handle.valid()) handles.push_back(handle);
      }
    }
  }
  // In issue order, so the first failure reported is the earliest.
  std::sort(handles.begin(), handles.end(), [](const Handle& a, const Handle& b) {
    return a.sequence() < b.sequence();
  });
  for (const auto& handle : handles) handle.wait();
}

TensorRef ReducerImpl::residual(size_t index) {
  HEMIOLA_CHECK(index < plan_.specs.size(), "gradient index ", index, " is out of range");
  std::vector<float>* r = reduction_->codec().residual(index);  // null: no error feedback
  HEMIOLA_CHECK(r != nullptr, "residual() needs ReducerOptions::compression ",
                listed(coding_names([](const Coding& c) { return c.residuals; }), "or"),
                " (error feedback)");
  HEMIOLA_CHECK(!marking(), "residual() while gradients are being marked");
  wait_all();  // every reduction submitted so far has written its residual
  return TensorRef{r->data(), DType::kFloat32, r->size(), Device{}};
}

std::vector<int> ReducerImpl::usage(uint64_t iteration) const {
  return reduction_->usage(iteration);
}

size_t ReducerImpl::pieces(size_t index) const {
  HEMIOLA_CHECK(index < plan_.specs.size(), "gradient index ", index, " is out of range");
  return plan_.placement[index].size();
}

std::vector<std::vector<size_t>> ReducerImpl::buckets() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : plan_.buckets) {
    // Pieces of one tensor are adjacent within a bucket: list it once.
    std::vector<size_t> tensors;
    for (size_t t : bucket.tensors) {
      if (tensors.empty() || tensors.back() != t) tensors.push_back(t);
    }
    out.push_back(std::move(tensors));
  }
  return out;
}

void ReducerImpl::rebuild_from_observed_order() {
  // Rank 0's order wins, so every rank builds the same plan. Tensors rank 0
  // never saw go last, in reverse registration order.
  const size_t n = plan_.specs.size();
  std::vector<int64_t> order(n);
  if (host_.options().rank == 0) {
    std::vector<bool> seen(n, false);
    size_t k = 0;
    for (size_t index : observed_order()) {
      order[k++] = static_cast<int64_t>(index);
      seen[index] = true;
    }
    for (size_t index : reverse_order(n)) {
      if (!seen[index]) order[k++] = static_cast<int64_t>(index);
    }
  }
  host_.broadcast(TensorRef{order.data(), DType::kInt64, order.size(), Device{}}, 0).wait();
  rebuild(std::vector<size_t>(order.begin(), order.end()));
}

void ReducerImpl::rebuild(const std::vector<size_t>& order) {
  HEMIOLA_CHECK(!marking(), "rebuild while gradients are being marked; finish the iteration first");
  wait_all();
  std::lock_guard<std::mutex> lock(ring_.mutex());
  build(order);
  ring_.stop_recording();
}

// ---- public facade ---------------------------------------------------------

Reducer::Reducer(std::unique_ptr<ReducerImpl> impl) : impl_(std::move(impl)) {}
Reducer::~Reducer() = default;

void Reducer::mark_ready(size_t index, const TensorRef& grad, StreamRef stream) {
  HEMIOLA_CHECK(index < impl_->size(), "gradient index ", index, " is out of range (",
                impl_->size(), " gradients)");
  const GradSpec& spec = impl_->spec(index);
  HEMIOLA_CHECK(grad.dtype == spec.dtype, "gradient '", spec.name, "' has dtype ",
                dtype_name(grad.dtype), " but was registered as ", dtype_name(spec.dtype));
  HEMIOLA_CHECK(grad.numel == spec.numel, "gradient '", spec.name, "' has ", grad.numel,
                " elements but was registered with ", spec.numel);
  const Device& device = impl_->device();
  HEMIOLA_CHECK(grad.device.type == device.type &&
                    (device.type == DeviceType::kCPU || grad.device.index == device.index),
                "gradient '", spec.name, "' is on ", describe_device(grad.device),
                " but the reducer is on ", describe_device(device));
  impl_->mark(index, grad.data, grad.data, grad.data, true, stream.handle);
}
void Reducer::mark_ready(size_t index, void* data, StreamRef stream) {
  impl_->mark(index, data, data, data, true, stream.handle);
}
void Reducer::mark_ready(size_t index, const void* source, void* out, StreamRef stream) {
  impl_->mark(index, source, source, out, true, stream.handle);
}
void Reducer::mark(size_t index, const void* source, const void* local, StreamRef stream) {
  impl_->mark(index, source, local, nullptr, true, stream.handle);
}
void Reducer::mark_unused(size_t index, StreamRef stream) {
  impl_->mark(index, nullptr, nullptr, nullptr, false, stream.handle);
}
void Reducer::observe_marks(MarkObserver& observer) { impl_->observe(observer); }
void Reducer::forget_marks(MarkObserver& observer) { impl_->forget(observer); }
std::vector<size_t> Reducer::unmarked() const { return impl_->unmarked(); }
bool Reducer::marking() const { return impl_->marking(); }
int64_t Reducer::finish_marking() { return impl_->finish_marking(); }
void Reducer::wait(uint64_t iteration, StreamRef stream) { impl_->wait(iteration, stream.handle); }
void Reducer::wait(StreamRef stream) {
  impl_->finish_marking();
  impl_->wait_all();
  const uint64_t started = impl_->iterations_started();
  // On the device iterations complete in order: waiting for the last is enough.
  if (started > 0) impl_->wait(started - 1, stream.handle);
}
void Reducer::wait_for(uint64_t iteration, const std::vector<size_t>& indices,
                       StreamRef stream) {
  impl_->wait_for(iteration, indices, stream.handle);
}
std::vector<size_t> Reducer::arrived(uint64_t iteration, const std::vector<size_t>& indices) const {
  return impl_->arrived(iteration, indices);
}
void Reducer::set_issue_order(const std::vector<size_t>& order) { impl_->set_issue_order(order); }
std::vector<size_t> Reducer::issue_order() const { return impl_->issue_order(); }
void Reducer::abort(const std::string& reason) { impl_->abort(reason); }
TensorRef Reducer::result(uint64_t iteration, size_t index) const {
  return impl_->result(iteration, index);
}
std::vector<int> Reducer::usage(uint64_t iteration) const { return impl_->usage(iteration); }
double Reducer::preview_error() const { return impl_->preview_error(); }
ReductionLane& Reducer::reduction_results() { return impl_->reduction(); }
LaneResults* Reducer::preview_results() { return impl_->preview(); }
void Reducer::drain(bool abort_marking) noexcept { impl_->drain(abort_marking); }
TensorRef Reducer::residual(size_t index) { return impl_->residual(index); }
void Reducer::set_compression(Compression compression, size_t powersgd_rank,
                              uint64_t powersgd_start_iteration) {
  impl_->set_compression(compression, powersgd_rank, powersgd_start_iteration);
}
std::vector<std::vector<size_t>> Reducer::buckets() const { return impl_->buckets(); }
std::vector<size_t> Reducer::observed_order() const { return impl_->observed_order(); }
size_t Reducer::pieces(size_t index) const { return impl_->pieces(index); }
const ReducerOptions& Reducer::options() const { return impl_->options(); }
void Reducer::rebuild_from_observed_order() { impl_->rebuild_from_observed_order(); }
void Reducer::rebuild(const std::vector<size_t>& order) { impl_->rebuild(order); }
uint64_t Reducer::iterations_started() const { return impl_->iterations_started(); }

}  // namespace hemiola
