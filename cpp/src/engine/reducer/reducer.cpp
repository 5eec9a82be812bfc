// The reducer's iteration lifecycle: flights taken and released, gradients
// marked into their buckets, each iteration's buckets walked in issue order
// on the scheduler thread, and the waits on the user's side. Where the bucket
// memory lives is the BucketStorage's business (bucket_storage.h).
#include "hemiola/reducer.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <sstream>

#include "core/dtype_math.h"
#include "engine/codec/preview.h"
#include "engine/reducer/reducer_impl.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

std::string describe_device(const Device& device) {
  return device.type == DeviceType::kCPU ? std::string("the CPU")
                                         : "CUDA device " + std::to_string(device.index);
}

}  // namespace

bool wait_for_flag(std::mutex& mutex, std::condition_variable& cv, const std::atomic<bool>& done,
                   const Handle& handle) {
  std::unique_lock<std::mutex> lock(mutex);
  while (!done.load(std::memory_order_acquire)) {
    if (handle.done()) break;
    cv.wait_for(lock, std::chrono::milliseconds(50));
  }
  return done.load(std::memory_order_acquire);
}

void set_flag(std::mutex& mutex, std::condition_variable& cv, std::atomic<bool>& done) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    done.store(true, std::memory_order_release);
  }
  cv.notify_all();
}

// The scheduler's view of one iteration: reduce its buckets in plan order.
class ReducerImpl::Work final : public hemiola::Work {
 public:
  Work(ReducerImpl& reducer, Flight& flight) : reducer_(reducer), flight_(flight) {}
  void run(Communicator& comm, Timeline& timeline) override {
    reducer_.run(flight_, comm, timeline, &current_bucket_);
  }
  std::string describe() const override {
    std::ostringstream out;
    out << "gradient reduction of iteration " << flight_.iteration;
    if (current_bucket_ != kNotStarted) out << reducer_.describe(current_bucket_);
    return out.str();
  }

 private:
  static constexpr size_t kNotStarted = static_cast<size_t>(-1);
  ReducerImpl& reducer_;
  Flight& flight_;
  size_t current_bucket_ = kNotStarted;  // written and read on the scheduler thread
};

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
  if (options_.preview) {
    HEMIOLA_CHECK(!on_device(), "ReducerOptions::preview is implemented for CPU reducers only");
    HEMIOLA_CHECK(preview_levels(engine.options().world_size) >= 1,
                  "ReducerOptions::preview codes the sum of all ranks in one byte, which needs "
                  "at most 127 ranks (world_size is ", engine.options().world_size, ")");
    // Now, at wrap time, not in a backward hook of the first iteration that
    // takes a preview.
    engine_.connect_preview_lane();
  }
  if (on_device()) {
    HEMIOLA_CHECK(options_.device.index >= 0, "a CUDA reducer needs a device index, got ",
                  options_.device.index);
  }
  codec_ = make_codec(options_.compression);
  observed_.assign(specs_.size(), 0);
  build(reverse_order(specs_.size()));
  if (on_device()) {
    // The device's stream and communicator are made now, on the scheduler
    // thread (a collective, in submission order), rather than inside the
    // first iteration: NCCL's initialisation synchronises the device, and
    // its errors belong to wrap time.
    set_up_device(engine_, options_.device.index);
  }
}

ReducerImpl::~ReducerImpl() {
  // Iteration work refers to our flights: never let it outlive us.
  abort("reducer destroyed");
  drain(/*abort_marking=*/false);
}

void ReducerImpl::drain(bool abort_marking) noexcept {
  if (abort_marking && marking()) {
    try {
      abort("the outputs of the iteration being marked were released (its updater was "
            "destroyed) before it finished");
    } catch (...) {
      aborted_.store(true, std::memory_order_release);  // without a reason (no memory for it)
    }
  }
  // An aborted iteration's work ends at its next look at the ready queue; a
  // running reduction ends within the engine's timeout; then the device's
  // share of it (unpacks into the outputs).
  for (auto& flight : flights_) {
    if (flight->handle.valid()) flight->handle.wait_for(std::chrono::hours(1));
    if (flight->preview && flight->preview->handle.valid()) {
      flight->preview->handle.wait_for(std::chrono::hours(1));
    }
    try {
      flight->storage->drain_device(timeout());
    } catch (...) {
      // A device that fails here has failed its work already.
    }
  }
}

void ReducerImpl::build(const std::vector<size_t>& order) {
  plan_ = plan_buckets(specs_, order, options_.first_bucket_bytes, options_.fusion_bytes,
                       options_.partition_bytes);
  placement_ = place_pieces(plan_, specs_.size());
  issue_order_.resize(plan_.size());
  for (size_t b = 0; b < plan_.size(); ++b) issue_order_[b] = b;
  flights_.clear();
  for (size_t f = 0; f < options_.in_flight + 1; ++f) {
    auto flight = std::make_unique<Flight>();
    flight->storage = make_storage();
    // No iteration yet: the waits and queries treat it as long completed.
    flight->iteration = kNoIteration;
    flight->pending.reset(new std::atomic<int64_t>[plan_.size()]());
    flight->bucket_done.reset(new std::atomic<bool>[plan_.size()]());
    flight->state.reset(new std::atomic<uint8_t>[specs_.size()]);
    flight->out.assign(specs_.size(), nullptr);
    flight->usage.assign(specs_.size(), 0.0f);
    flight->queue = std::make_unique<ReadyQueue<uint32_t>>(plan_.size());
    if (options_.preview) flight->preview = make_preview();
    flights_.push_back(std::move(flight));
  }
  preview_scales_.clear();
  if (options_.preview) {
    for (const auto& bucket : plan_) {
      preview_scales_.emplace_back((bucket.numel + kPreviewBlock - 1) / kPreviewBlock, 0.0f);
    }
  }
  plan_start_ = started_.load();
}

std::unique_ptr<Codec> ReducerImpl::make_codec(Compression compression) const {
  return hemiola::make_codec(CodecSpec{specs_, options_.device, compression, options_.average,
                                       engine_.options().world_size, options_.powersgd_rank,
                                       options_.powersgd_start_iteration});
}

void ReducerImpl::set_compression(Compression compression, size_t powersgd_rank,
                                  uint64_t powersgd_start_iteration) {
  std::lock_guard<std::mutex> lock(mutex_);
  HEMIOLA_CHECK(started_.load() == 0 && !marking(),
                "set_compression after the first iteration started; set it before");
  options_.powersgd_rank = powersgd_rank;
  options_.powersgd_start_iteration = powersgd_start_iteration;
  codec_ = make_codec(compression);
  options_.compression = compression;
  // The storages keep the codec's wire memory: make them anew (no iteration
  // has used them).
  for (auto& flight : flights_) flight->storage = make_storage();
}

std::unique_ptr<BucketStorage> ReducerImpl::make_storage() {
  const BucketLayout layout{plan_, placement_, specs_};
  if (on_device()) {
    return make_device_buckets(layout, engine_.devices(), options_.device.index,
                               codec_->wire_bytes(plan_), timeout());
  }
  return make_host_buckets(layout);
}

std::chrono::milliseconds ReducerImpl::timeout() const {
  return std::chrono::milliseconds(static_cast<int64_t>(engine_.options().timeout_s * 1000.0));
}

void ReducerImpl::check_usable() const {
  if (aborted_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    HEMIOLA_THROW(ErrorCode::kAborted, "this reducer was aborted earlier (", abort_reason_,
                  "); re-create the wrapped model to continue");
  }
}

ReducerImpl::Flight& ReducerImpl::begin_iteration() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Flight* current = marking_.load(std::memory_order_acquire)) return *current;
  const uint64_t iteration = started_.load();
  Flight& flight = *flights_[iteration % flights_.size()];
  // The in-flight bound: the iteration that used this flight last must be
  // done before its buffers are reused.
  if (flight.handle.valid()) flight.handle.wait();
  if (flight.preview && flight.preview->handle.valid()) flight.preview->handle.wait();
  if (options_.preview && iteration > 0) {
    // The previous iteration's preview reads the flight reused now (its
    // scales' iteration's bucket states): it must be done first. It needs
    // nothing more than what has happened already, so this is short.
    Flight& last = *flights_[(iteration - 1) % flights_.size()];
    if (last.preview->handle.valid()) last.preview->handle.wait();
  }
  for (size_t b = 0; b < plan_.size(); ++b) {
    flight.pending[b].store(static_cast<int64_t>(plan_[b].tensors.size()),
                            std::memory_order_relaxed);
    flight.bucket_done[b].store(false, std::memory_order_relaxed);
  }
  for (size_t i = 0; i < specs_.size(); ++i) {
    flight.state[i].store(kPending, std::memory_order_relaxed);
    flight.out[i] = nullptr;
  }
  flight.storage->begin_iteration();
  Preview* preview = flight.preview.get();
  if (preview) {
    // The scales come from the previous iteration, reduced under this plan.
    preview->active = iteration > plan_start_;
    for (size_t b = 0; b < plan_.size(); ++b) {
      preview->done[b].store(false, std::memory_order_relaxed);
    }
  }
  flight.iteration = iteration;
  // The preview first: the main lane's work waits on its handle.
  if (preview && preview->active) {
    preview->handle = submit_preview(flight);
  }
  flight.handle = engine_.submit(std::make_shared<Work>(*this, flight));
  started_.store(iteration + 1, std::memory_order_release);
  marking_.store(&flight, std::memory_order_release);
  return flight;
}

void ReducerImpl::mark(size_t index, const void* source, void* out, bool used, void* stream) {
  HEMIOLA_CHECK(index < specs_.size(), "gradient index ", index, " is out of range (",
                specs_.size(), " gradients)");
  const GradSpec& spec = specs_[index];
  HEMIOLA_CHECK(!used || source != nullptr || spec.numel == 0, "gradient '", spec.name,
                "' has a null data pointer");
  check_usable();
  Flight* current = marking_.load(std::memory_order_acquire);
  Flight& flight = current ? *current : begin_iteration();
  uint8_t expected = kPending;
  if (!flight.state[index].compare_exchange_strong(expected, used ? kReady : kUnused,
                                                    std::memory_order_acq_rel)) {
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "gradient '", spec.name,
                  "' was marked ready twice in one iteration. Each parameter must produce one "
                  "gradient per backward pass (reentrant checkpointing, or a second backward "
                  "without finishing the first, can cause this)");
  }
  if (used) flight.out[index] = out;
  flight.usage[index] = used ? 1.0f : 0.0f;
  if (recording_.load(std::memory_order_relaxed)) {
    observed_[observed_count_.fetch_add(1, std::memory_order_relaxed)] = index;
  }
  flight.storage->copy_in(index, source, used, stream);
  for (const Placement& piece : placement_[index]) {
    // The last piece of a bucket enqueues it. acq_rel: the scheduler, which
    // reads the buffer after popping, must see every producer's memcpy.
    if (flight.pending[piece.bucket].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      const auto bucket = static_cast<uint32_t>(piece.bucket);
      const bool previewing = flight.preview && flight.preview->active;
      if (!flight.queue->push(bucket) || (previewing && !flight.preview->queue->push(bucket))) {
        HEMIOLA_THROW(ErrorCode::kInternal, "ready queue overflow");
      }
    }
  }
}

std::vector<size_t> ReducerImpl::unmarked() const {
  const Flight* flight = marking_.load(std::memory_order_acquire);
  std::vector<size_t> out;
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (!flight || flight->state[i].load(std::memory_order_acquire) == kPending) out.push_back(i);
  }
  return out;
}

int64_t ReducerImpl::finish_marking() {
  check_usable();
  std::lock_guard<std::mutex> lock(mutex_);
  Flight* flight = marking_.load(std::memory_order_acquire);
  if (!flight) return -1;
  std::vector<size_t> missing;
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (flight->state[i].load(std::memory_order_acquire) == kPending) missing.push_back(i);
  }
  HEMIOLA_CHECK(missing.empty(), "iteration ", flight->iteration, " finished without gradients ",
                "for ", missing.size(), " tensor(s): ", names(missing),
                " (mark them ready or unused first)");
  if (recording_.load()) recording_.store(false);  // the first iteration is recorded
  marking_.store(nullptr, std::memory_order_release);
  return static_cast<int64_t>(flight->iteration);
}

void ReducerImpl::run(Flight& flight, Communicator& comm, Timeline& timeline,
                      size_t* current_bucket) {
  const size_t count = plan_.size();
  std::vector<bool> ready(count, false);
  const BucketStorage* previous =
      flight.iteration == 0 ? nullptr
                            : flights_[(flight.iteration - 1) % flights_.size()]->storage.get();
  flight.storage->begin_reductions(flight.iteration, previous);
  // With a preview, the full reductions wait for all of it: it is what the
  // next forward needs first, and the full reductions have the whole next
  // iteration to run, so they do not compete with it for the network.
  if (flight.preview && flight.preview->active) wait_previews(flight, timeline);
  // Fixed issue order: bucket b goes only after the buckets before it in
  // issue_order_, whatever order buckets became ready in on this rank.
  for (size_t position = 0; position < count; ++position) {
    const size_t b = issue_order_[position];
    *current_bucket = position;
    wait_ready(*flight.queue, b, ready, timeline, "comm");
    reduce(flight, b, comm, timeline);
  }
  *current_bucket = count;
  if (options_.track_usage) {
    comm.all_reduce_sum(TensorRef{flight.usage.data(), DType::kFloat32, flight.usage.size(), {}});
  }
  flight.storage->end_reductions();
}

void ReducerImpl::wait_ready(ReadyQueue<uint32_t>& queue, size_t b, std::vector<bool>& ready,
                             Timeline& timeline, const char* lane) {
  const auto timeout = this->timeout();
  const auto wait_start = std::chrono::steady_clock::now();
  const int64_t wait_us = timeline.now_us();
  while (!ready[b]) {
    uint32_t id;
    if (queue.pop_wait(id, std::chrono::milliseconds(100))) {
      ready[id] = true;
      continue;
    }
    if (aborted_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      HEMIOLA_THROW(ErrorCode::kAborted, "aborted: ", abort_reason_);
    }
    if (std::chrono::steady_clock::now() - wait_start > timeout) {
      HEMIOLA_THROW(ErrorCode::kTimeout, "on this rank, bucket ", b, " never became ready within ",
                    engine_.options().timeout_s, " s: its gradients were never produced");
    }
  }
  if (timeline.enabled() && timeline.now_us() - wait_us > 1) {
    timeline.record(lane, "wait bucket " + std::to_string(b), "wait", wait_us, timeline.now_us());
  }
}

void ReducerImpl::reduce(Flight& flight, size_t b, Communicator& comm, Timeline& timeline) {
  const int64_t start_us = timeline.now_us();
  codec_->reduce(*flight.storage, b, flight.iteration, flight.out, comm);
  if (options_.preview) after_reduced(flight, b);
  set_flag(flight.bucket_mutex, flight.bucket_cv, flight.bucket_done[b]);
  if (timeline.enabled()) {
    timeline.record("comm",
                    "allreduce bucket " + std::to_string(b) + " (iteration " +
                        std::to_string(flight.iteration) + ")",
                    "allreduce", start_us, timeline.now_us());
  }
}

void ReducerImpl::wait(uint64_t iteration, void* stream) {
  Handle handle;
  const BucketStorage* storage = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HEMIOLA_CHECK(iteration < started_.load(), "iteration ", iteration, " has not started");
    const Flight& flight = *flights_[iteration % flights_.size()];
    if (flight.iteration != iteration) return;  // reused: it completed long ago
    HEMIOLA_CHECK(marking_.load() != &flight, "wait(", iteration,
                  ") while its gradients are still being marked; call finish_marking() first");
    handle = flight.handle;
    storage = flight.storage.get();
  }
  handle.wait();
  storage->block_until_done(stream);
}

void ReducerImpl::wait_for(uint64_t iteration, const std::vector<size_t>& indices,
                           void* stream) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HEMIOLA_CHECK(iteration < started_.load(), "iteration ", iteration, " has not started");
    const Flight& flight = *flights_[iteration % flights_.size()];
    HEMIOLA_CHECK(flight.iteration != iteration || marking_.load() != &flight, "wait_for(",
                  iteration, ", ...) while its gradients are still being marked; call "
                  "finish_marking() first");
  }
  std::vector<bool> needed(plan_.size(), false);
  for (size_t i : indices) {
    HEMIOLA_CHECK(i < specs_.size(), "gradient index ", i, " is out of range (", specs_.size(),
                  " gradients)");
    for (const Placement& piece : placement_[i]) needed[piece.bucket] = true;
  }
  for (size_t b : issue_order()) {
    if (needed[b]) wait_bucket(iteration, b, stream);
  }
}

std::vector<size_t> ReducerImpl::arrived(uint64_t iteration,
                                         const std::vector<size_t>& indices) const {
  std::vector<int8_t> known(plan_.size(), -1);  // per bucket: unknown, not done, done
  std::vector<size_t> out;
  for (size_t i : indices) {
    HEMIOLA_CHECK(i < specs_.size(), "gradient index ", i, " is out of range (", specs_.size(),
                  " gradients)");
    bool all = true;
    for (const Placement& piece : placement_[i]) {
      int8_t& done = known[piece.bucket];
      if (done < 0) done = bucket_done(iteration, piece.bucket) ? 1 : 0;
      all = all && done == 1;
    }
    if (all) out.push_back(i);
  }
  return out;
}

void ReducerImpl::wait_bucket(uint64_t iteration, size_t bucket, void* stream) {
  HEMIOLA_CHECK(bucket < plan_.size(), "bucket ", bucket, " is out of range (", plan_.size(),
                " buckets)");
  Flight* flight;
  Handle handle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HEMIOLA_CHECK(iteration < started_.load(), "iteration ", iteration, " has not started");
    flight = flights_[iteration % flights_.size()].get();
    if (flight->iteration != iteration) return;  // reused: it completed long ago
    handle = flight->handle;
  }
  // Wake up for the bucket, or for the end of the whole iteration (which is
  // also how a failure arrives); the handle then rethrows it.
  if (!wait_for_flag(flight->bucket_mutex, flight->bucket_cv, flight->bucket_done[bucket], handle)) {
    handle.wait();
  }
  flight->storage->block_until_reduced(bucket, stream);
}

bool ReducerImpl::bucket_done(uint64_t iteration, size_t bucket) const {
  HEMIOLA_CHECK(bucket < plan_.size(), "bucket ", bucket, " is out of range");
  if (iteration >= started_.load()) return false;
  const Flight& flight = *flights_[iteration % flights_.size()];
  if (flight.iteration != iteration) return true;  // reused: it completed long ago
  // On CUDA: enqueued, and complete on the device.
  return flight.bucket_done[bucket].load(std::memory_order_acquire) &&
         flight.storage->reduced(bucket);
}

void ReducerImpl::set_issue_order(const std::vector<size_t>& order) {
  check_permutation(order, plan_.size());
  HEMIOLA_CHECK(!marking(), "set_issue_order while gradients are being marked");
  wait_all();
  std::lock_guard<std::mutex> lock(mutex_);
  issue_order_ = order;
}

std::vector<size_t> ReducerImpl::issue_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return issue_order_;
}

void ReducerImpl::wait_all() {
  std::vector<Handle> handles;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& flight : flights_) {
      if (flight->handle.valid()) handles.push_back(flight->handle);
      if (flight->preview && flight->preview->handle.valid()) {
        handles.push_back(flight->preview->handle);
      }
    }
  }
  // In iteration order, so the first failure reported is the earliest.
  std::sort(handles.begin(), handles.end(), [](const Handle& a, const Handle& b) {
    return a.sequence() < b.sequence();
  });
  for (const auto& handle : handles) handle.wait();
}

void ReducerImpl::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (!aborted_.load()) abort_reason_ = reason;
    aborted_.store(true, std::memory_order_release);
  }
  for (auto& flight : flights_) {
    flight->queue->wake();
    if (flight->preview) flight->preview->queue->wake();
  }
}

const ReducerImpl::Flight& ReducerImpl::completed_flight(uint64_t iteration) const {
  const Flight& flight = *flights_[iteration % flights_.size()];
  HEMIOLA_CHECK(iteration < started_.load() && flight.iteration == iteration, "iteration ",
                iteration, "'s results are gone (its buffers were reused by a later iteration)");
  HEMIOLA_CHECK(marking_.load() != &flight && flight.handle.done(), "iteration ", iteration,
                " is not reduced yet; call wait(", iteration, ") first");
  return flight;
}

TensorRef ReducerImpl::result(uint64_t iteration, size_t index) const {
  HEMIOLA_CHECK(index < specs_.size(), "gradient index ", index, " is out of range");
  HEMIOLA_CHECK(placement_[index].size() == 1, "gradient '", specs_[index].name,
                "' is partitioned across ", placement_[index].size(),
                " buckets, so its result is not contiguous here: pass an output to mark_ready");
  const Placement& where = placement_[index].front();
  const Flight& flight = *flights_[iteration % flights_.size()];
  HEMIOLA_CHECK(iteration < started_.load() && flight.iteration == iteration, "iteration ",
                iteration, "'s results are gone (its buffers were reused by a later iteration)");
  HEMIOLA_CHECK(flight.bucket_done[where.bucket].load(std::memory_order_acquire), "iteration ",
                iteration, "'s bucket ", where.bucket, " ('", specs_[index].name,
                "') is not reduced yet; wait for it first");
  const GradSpec& spec = specs_[index];
  return TensorRef{flight.storage->buffer(where.bucket) + where.offset * dtype_size(spec.dtype),
                   spec.dtype, spec.numel, options_.device};
}

TensorRef ReducerImpl::residual(size_t index) {
  HEMIOLA_CHECK(index < specs_.size(), "gradient index ", index, " is out of range");
  std::vector<float>* r = codec_->residual(index);  // null: no error feedback
  HEMIOLA_CHECK(r != nullptr,
                "residual() needs ReducerOptions::compression int8 or powersgd (error feedback)");
  HEMIOLA_CHECK(!marking(), "residual() while gradients are being marked");
  wait_all();  // every reduction submitted so far has written its residual
  return TensorRef{r->data(), DType::kFloat32, r->size(), Device{}};
}

std::vector<int> ReducerImpl::usage(uint64_t iteration) const {
  HEMIOLA_CHECK(options_.track_usage, "usage() needs ReducerOptions::track_usage");
  const Flight& flight = completed_flight(iteration);
  std::vector<int> out(flight.usage.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int>(flight.usage[i] + 0.5f);
  return out;
}

size_t ReducerImpl::pieces(size_t index) const {
  HEMIOLA_CHECK(index < specs_.size(), "gradient index ", index, " is out of range");
  return placement_[index].size();
}

std::vector<std::vector<size_t>> ReducerImpl::buckets() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& bucket : plan_) {
    // Pieces of one tensor are adjacent within a bucket: list it once.
    std::vector<size_t> tensors;
    for (size_t t : bucket.tensors) {
      if (tensors.empty() || tensors.back() != t) tensors.push_back(t);
    }
    out.push_back(std::move(tensors));
  }
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
  rebuild(std::vector<size_t>(order.begin(), order.end()));
}

void ReducerImpl::rebuild(const std::vector<size_t>& order) {
  HEMIOLA_CHECK(!marking(), "rebuild while gradients are being marked; finish the iteration first");
  wait_all();
  std::lock_guard<std::mutex> lock(mutex_);
  build(order);
  recording_.store(false);
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
  impl_->mark(index, grad.data, grad.data, true, stream.handle);
}
void Reducer::mark_ready(size_t index, void* data, StreamRef stream) {
  impl_->mark(index, data, data, true, stream.handle);
}
void Reducer::mark_ready(size_t index, const void* source, void* out, StreamRef stream) {
  impl_->mark(index, source, out, true, stream.handle);
}
void Reducer::mark_unused(size_t index, StreamRef stream) {
  impl_->mark(index, nullptr, nullptr, false, stream.handle);
}
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
