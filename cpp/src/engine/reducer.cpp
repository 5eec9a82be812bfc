#include "hemiola/reducer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

#include "engine/dtype_math.h"
#include "engine/reducer_impl.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

class IterationWork final : public Work {
 public:
  IterationWork(ReducerImpl& reducer, uint64_t iteration)
      : reducer_(reducer), iteration_(iteration) {}
  void run(Communicator& comm, Timeline& timeline) override {
    reducer_.run_iteration(comm, timeline, iteration_, &current_bucket_);
  }
  std::string describe() const override {
    std::ostringstream out;
    out << "gradient reduction of iteration " << iteration_;
    if (current_bucket_ != kNotStarted) out << reducer_.describe_pending(current_bucket_);
    return out.str();
  }

 private:
  static constexpr size_t kNotStarted = static_cast<size_t>(-1);
  ReducerImpl& reducer_;
  uint64_t iteration_;
  size_t current_bucket_ = kNotStarted;  // written and read on the scheduler thread
};

std::string join_names(const std::vector<GradSpec>& specs, const std::vector<size_t>& indices,
                       size_t limit = 8) {
  std::ostringstream out;
  for (size_t i = 0; i < indices.size() && i < limit; ++i) {
    out << (i ? ", " : "") << specs[indices[i]].name;
  }
  if (indices.size() > limit) out << ", ... (" << indices.size() - limit << " more)";
  return out.str();
}

}  // namespace

ReducerImpl::ReducerImpl(EngineImpl& engine, std::vector<GradSpec> specs,
                         const ReducerOptions& options)
    : engine_(engine),
      specs_(std::move(specs)),
      options_(options),
      scale_(options.average ? 1.0 / engine.options().world_size : 1.0),
      recording_(options.record_order) {
  HEMIOLA_CHECK(!specs_.empty(), "a reducer needs at least one gradient tensor");
  HEMIOLA_CHECK(options_.fusion_bytes > 0 && options_.first_bucket_bytes > 0,
                "fusion_bytes and first_bucket_bytes must be positive");
  for (size_t i = 0; i < specs_.size(); ++i) {
    HEMIOLA_CHECK(is_floating(specs_[i].dtype), "gradient '", specs_[i].name, "' has dtype ",
                  dtype_name(specs_[i].dtype),
                  "; supported gradient dtypes are float32, float64, float16 and bfloat16");
  }
  observed_.assign(specs_.size(), 0);
  usage_.assign(specs_.size(), 0.0f);
  build(reverse_order(specs_.size()));
}

ReducerImpl::~ReducerImpl() {
  // The iteration's work refers to this reducer: never let it outlive us.
  Handle current;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    current = current_;
  }
  if (current.valid() && !current.done()) {
    abort("reducer destroyed during an iteration");
    current.wait_for(std::chrono::hours(1));
  }
}

void ReducerImpl::build(const std::vector<size_t>& order) {
  auto planned = plan_buckets(specs_, order, options_.first_bucket_bytes, options_.fusion_bytes);
  std::vector<std::unique_ptr<Bucket>> buckets;
  auto slots = std::make_unique<Slot[]>(specs_.size());
  for (size_t b = 0; b < planned.size(); ++b) {
    auto bucket = std::make_unique<Bucket>();
    bucket->plan = std::move(planned[b]);
    // Zero-filled, so a zero-element bucket and unused slots read as zeros.
    bucket->buffer.reset(new unsigned char[std::max<size_t>(bucket->plan.nbytes(), 1)]());
    bucket->pending.store(static_cast<int64_t>(bucket->plan.tensors.size()));
    for (size_t k = 0; k < bucket->plan.tensors.size(); ++k) {
      Slot& slot = slots[bucket->plan.tensors[k]];
      slot.bucket = b;
      slot.offset = bucket->plan.offsets[k];
    }
    buckets.push_back(std::move(bucket));
  }
  buckets_ = std::move(buckets);
  slots_ = std::move(slots);
  queue_ = std::make_unique<ReadyQueue<uint32_t>>(buckets_.size());
}

void ReducerImpl::check_usable() const {
  if (aborted_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mutex_);
    HEMIOLA_THROW(ErrorCode::kAborted, "this reducer was aborted earlier (", abort_reason_,
                  "); re-create the wrapped model to continue");
  }
}

void ReducerImpl::begin_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_.load(std::memory_order_acquire)) return;
  current_ = engine_.submit(std::make_shared<IterationWork>(*this, iteration_.load()));
  open_.store(true, std::memory_order_release);
}

void ReducerImpl::claim(size_t index, SlotState state, const void* source) {
  HEMIOLA_CHECK(index < specs_.size(), "gradient index ", index, " is out of range (",
                specs_.size(), " gradients)");
  check_usable();
  if (!open_.load(std::memory_order_acquire)) begin_iteration();
  Slot& slot = slots_[index];
  uint8_t expected = kPending;
  if (!slot.state.compare_exchange_strong(expected, state, std::memory_order_acq_rel)) {
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "gradient '", specs_[index].name,
                  "' was marked ready twice in one iteration. Each parameter must produce one "
                  "gradient per backward pass (reentrant checkpointing or a second backward "
                  "before the reduction finished can cause this)");
  }
  Bucket& bucket = *buckets_[slot.bucket];
  const GradSpec& spec = specs_[index];
  const size_t elem = dtype_size(spec.dtype);
  unsigned char* dst = bucket.buffer.get() + slot.offset * elem;
  if (state == kReady) {
    slot.out = const_cast<void*>(source);
    std::memcpy(dst, source, spec.numel * elem);
    usage_[index] = 1.0f;
  } else {
    slot.out = nullptr;
    std::memset(dst, 0, spec.numel * elem);
    usage_[index] = 0.0f;
  }
  if (recording_.load(std::memory_order_relaxed)) {
    observed_[observed_count_.fetch_add(1, std::memory_order_relaxed)] = index;
  }
  // The last gradient of a bucket enqueues it. acq_rel: the scheduler, which
  // reads the buffer after popping, must see every producer's memcpy.
  if (bucket.pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    const bool pushed = queue_->push(static_cast<uint32_t>(slot.bucket));
    if (!pushed) HEMIOLA_THROW(ErrorCode::kInternal, "ready queue overflow");
  }
}

void ReducerImpl::mark_ready(size_t index, const void* data) {
  HEMIOLA_CHECK(data != nullptr || specs_.at(index).numel == 0, "gradient '",
                specs_.at(index).name, "' has a null data pointer");
  claim(index, kReady, data);
}

void ReducerImpl::mark_unused(size_t index) { claim(index, kUnused, nullptr); }

std::vector<size_t> ReducerImpl::unmarked() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (slots_[i].state.load(std::memory_order_acquire) == kPending) out.push_back(i);
  }
  return out;
}

void ReducerImpl::run_iteration(Communicator& comm, Timeline& timeline, uint64_t iteration,
                                size_t* current_bucket) {
  const auto timeout = std::chrono::milliseconds(
      static_cast<int64_t>(engine_.options().timeout_s * 1000.0));
  const size_t count = buckets_.size();
  std::vector<bool> ready(count, false);
  for (size_t b = 0; b < count; ++b) {
    *current_bucket = b;
    // Fixed issue order: bucket b goes only after 0..b-1, whatever order
    // buckets became ready in on this rank.
    const auto wait_start = std::chrono::steady_clock::now();
    const int64_t wait_us = timeline.now_us();
    while (!ready[b]) {
      uint32_t id;
      if (queue_->pop_wait(id, std::chrono::milliseconds(100))) {
        ready[id] = true;
        continue;
      }
      if (aborted_.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(mutex_);
        HEMIOLA_THROW(ErrorCode::kAborted, "aborted: ", abort_reason_);
      }
      if (std::chrono::steady_clock::now() - wait_start > timeout) {
        HEMIOLA_THROW(ErrorCode::kTimeout, "on this rank, bucket ", b, " never became ready within ",
                      engine_.options().timeout_s, " s: its gradients were never produced");
      }
    }
    Bucket& bucket = *buckets_[b];
    const PlannedBucket& plan = bucket.plan;
    const int64_t start_us = timeline.now_us();
    if (timeline.enabled() && start_us - wait_us > 1) {
      timeline.record("comm", "wait bucket " + std::to_string(b), "wait", wait_us, start_us);
    }
    TensorRef ref{bucket.buffer.get(), plan.dtype, plan.numel, Device{}};
    comm.all_reduce_sum(ref);
    if (scale_ != 1.0) scale_in_place(plan.dtype, ref.data, ref.numel, scale_);
    const size_t elem = dtype_size(plan.dtype);
    for (size_t k = 0; k < plan.tensors.size(); ++k) {
      const Slot& slot = slots_[plan.tensors[k]];
      if (slot.out != nullptr) {
        std::memcpy(slot.out, bucket.buffer.get() + plan.offsets[k] * elem,
                    specs_[plan.tensors[k]].numel * elem);
      }
    }
    timeline.record("comm", "allreduce bucket " + std::to_string(b), "allreduce", start_us,
                    timeline.now_us());
  }
  *current_bucket = count;
  if (options_.track_usage) {
    comm.all_reduce_sum(TensorRef{usage_.data(), DType::kFloat32, usage_.size(), Device{}});
  }
  (void)iteration;
  // Slot states stay as they are: the caller may still inspect them (e.g.
  // unmarked()) until wait() closes the iteration on its own thread.
}

// Called by wait() on the caller's thread once the iteration's work is done:
// the scheduler no longer touches the per-iteration state, and hooks of the
// next iteration cannot have started (they come after wait() returns).
void ReducerImpl::reset_iteration() {
  for (auto& bucket : buckets_) {
    bucket->pending.store(static_cast<int64_t>(bucket->plan.tensors.size()),
                          std::memory_order_relaxed);
  }
  for (size_t i = 0; i < specs_.size(); ++i) {
    slots_[i].state.store(kPending, std::memory_order_relaxed);
  }
  if (recording_.load(std::memory_order_relaxed)) recording_.store(false);
  iteration_.fetch_add(1, std::memory_order_release);
  open_.store(false, std::memory_order_release);
}

std::string ReducerImpl::describe_pending(size_t from_bucket) const {
  std::ostringstream out;
  const size_t count = buckets_.size();
  if (from_bucket >= count) {
    out << ", at the usage all-reduce after all " << count << " buckets";
    return out.str();
  }
  const PlannedBucket& plan = buckets_[from_bucket]->plan;
  out << ", at bucket " << from_bucket << " of " << count << " (" << dtype_name(plan.dtype) << ", "
      << plan.nbytes() << " bytes; parameters: " << join_names(specs_, plan.tensors) << ")";
  if (from_bucket + 1 < count) {
    std::vector<size_t> rest;
    for (size_t b = from_bucket + 1; b < count; ++b) {
      for (size_t t : buckets_[b]->plan.tensors) rest.push_back(t);
    }
    out << "; still pending after it: buckets " << from_bucket + 1 << ".." << count - 1
        << " (parameters: " << join_names(specs_, rest, 4) << ")";
  }
  return out.str();
}

void ReducerImpl::wait() {
  Handle current;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!open_.load(std::memory_order_acquire)) {
      if (aborted_.load()) {
        HEMIOLA_THROW(ErrorCode::kAborted, "this reducer was aborted earlier (", abort_reason_,
                      ")");
      }
      return;  // nothing in flight
    }
    current = current_;
  }
  current.wait();  // throws on failure; the iteration then stays open (failed)
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_.load(std::memory_order_acquire)) reset_iteration();
}

void ReducerImpl::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aborted_.load()) abort_reason_ = reason;
    aborted_.store(true, std::memory_order_release);
  }
  if (queue_) queue_->wake();
}

void ReducerImpl::copy_out(size_t index, const TensorRef& dst) const {
  HEMIOLA_CHECK(index < specs_.size(), "gradient index ", index, " is out of range");
  const GradSpec& spec = specs_[index];
  HEMIOLA_CHECK(dst.dtype == spec.dtype && dst.numel == spec.numel, "copy_out: destination for '",
                spec.name, "' must be ", spec.numel, " x ", dtype_name(spec.dtype));
  HEMIOLA_CHECK(!open_.load(), "copy_out during an iteration; call wait() first");
  const Slot& slot = slots_[index];
  const size_t elem = dtype_size(spec.dtype);
  std::memcpy(dst.data, buckets_[slot.bucket]->buffer.get() + slot.offset * elem,
              spec.numel * elem);
}

std::vector<int> ReducerImpl::usage() const {
  HEMIOLA_CHECK(options_.track_usage, "usage() needs ReducerOptions::track_usage");
  std::vector<int> out(usage_.size());
  for (size_t i = 0; i < usage_.size(); ++i) out[i] = static_cast<int>(usage_[i] + 0.5f);
  return out;
}

std::vector<std::vector<size_t>> ReducerImpl::buckets() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : buckets_) out.push_back(bucket->plan.tensors);
  return out;
}

std::vector<size_t> ReducerImpl::observed_order() const {
  const size_t count = std::min(observed_count_.load(), specs_.size());
  return std::vector<size_t>(observed_.begin(), observed_.begin() + static_cast<long>(count));
}

void ReducerImpl::rebuild_from_observed_order() {
  // Rank 0's order wins, so every rank builds the same plan. Tensors rank 0
  // never saw go last, in reverse registration order.
  std::vector<int64_t> order(specs_.size());
  if (engine_.options().rank == 0) {
    std::vector<bool> seen(specs_.size(), false);
    size_t k = 0;
    for (size_t index : observed_order()) {
      order[k++] = static_cast<int64_t>(index);
      seen[index] = true;
    }
    for (size_t index : reverse_order(specs_.size())) {
      if (!seen[index]) order[k++] = static_cast<int64_t>(index);
    }
  }
  engine_.broadcast(TensorRef{order.data(), DType::kInt64, order.size(), Device{}}, 0).wait();
  std::vector<size_t> adopted(order.begin(), order.end());
  rebuild(adopted);
}

void ReducerImpl::rebuild(const std::vector<size_t>& order) {
  std::lock_guard<std::mutex> lock(mutex_);
  HEMIOLA_CHECK(!open_.load(), "rebuild during an iteration; call wait() first");
  build(order);
  recording_.store(false);
}

// ---- public facade ---------------------------------------------------------

Reducer::Reducer(std::unique_ptr<ReducerImpl> impl) : impl_(std::move(impl)) {}
Reducer::~Reducer() = default;

void Reducer::mark_ready(size_t index, const TensorRef& grad) {
  HEMIOLA_CHECK(index < impl_->size(), "gradient index ", index, " is out of range (",
                impl_->size(), " gradients)");
  const GradSpec& spec = impl_->spec(index);
  HEMIOLA_CHECK(grad.dtype == spec.dtype, "gradient '", spec.name, "' has dtype ",
                dtype_name(grad.dtype), " but was registered as ", dtype_name(spec.dtype));
  HEMIOLA_CHECK(grad.numel == spec.numel, "gradient '", spec.name, "' has ", grad.numel,
                " elements but was registered with ", spec.numel);
  HEMIOLA_CHECK(grad.device.type == DeviceType::kCPU,
                "gradient '", spec.name, "' is on a CUDA device; this build reduces CPU tensors only");
  impl_->mark_ready(index, grad.data);
}
void Reducer::mark_ready(size_t index, void* data) { impl_->mark_ready(index, data); }
void Reducer::mark_unused(size_t index) { impl_->mark_unused(index); }
std::vector<size_t> Reducer::unmarked() const { return impl_->unmarked(); }
bool Reducer::in_iteration() const { return impl_->in_iteration(); }
void Reducer::wait() { impl_->wait(); }
void Reducer::abort(const std::string& reason) { impl_->abort(reason); }
void Reducer::copy_out(size_t index, const TensorRef& dst) const { impl_->copy_out(index, dst); }
std::vector<int> Reducer::usage() const { return impl_->usage(); }
std::vector<std::vector<size_t>> Reducer::buckets() const { return impl_->buckets(); }
std::vector<size_t> Reducer::observed_order() const { return impl_->observed_order(); }
void Reducer::rebuild_from_observed_order() { impl_->rebuild_from_observed_order(); }
void Reducer::rebuild(const std::vector<size_t>& order) { impl_->rebuild(order); }
uint64_t Reducer::iteration() const { return impl_->iteration(); }

}  // namespace hemiola
