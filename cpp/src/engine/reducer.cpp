#include "hemiola/reducer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <sstream>

#include "engine/devices.h"
#include "engine/dtype_math.h"
#include "engine/preview.h"
#include "engine/reducer_impl.h"
#include "hemiola/status.h"
#include "kernels.h"

namespace hemiola {

namespace {

std::string describe_device(const Device& device) {
  return device.type == DeviceType::kCPU ? std::string("the CPU")
                                         : "CUDA device " + std::to_string(device.index);
}

// Names of the tensors `indices` (adjacent repeats, i.e. pieces of one
// partitioned tensor, named once), at most `limit` of them.
std::string join_names(const std::vector<GradSpec>& specs, const std::vector<size_t>& indices,
                       size_t limit = 8) {
  std::vector<size_t> unique;
  for (size_t i : indices) {
    if (unique.empty() || unique.back() != i) unique.push_back(i);
  }
  std::ostringstream out;
  for (size_t i = 0; i < unique.size() && i < limit; ++i) {
    out << (i ? ", " : "") << specs[unique[i]].name;
  }
  if (unique.size() > limit) out << ", ... (" << unique.size() - limit << " more)";
  return out.str();
}

// Blocks until `done` is set (it is set, and `cv` notified, under `mutex`),
// or until the work of `handle`, which sets it, ends without setting it (it
// failed); returns whether it was set. (User threads then rethrow with
// handle.wait(); engine threads must not, because a failure's diagnosis may
// call into a user-provided store.)
bool wait_for_flag(std::mutex& mutex, std::condition_variable& cv, const std::atomic<bool>& done,
                   const Handle& handle) {
  std::unique_lock<std::mutex> lock(mutex);
  while (!done.load(std::memory_order_acquire)) {
    if (handle.done()) break;
    cv.wait_for(lock, std::chrono::milliseconds(50));
  }
  return done.load(std::memory_order_acquire);
}

// Creates the engine's stream and communicator for a CUDA device.
class DeviceSetup final : public hemiola::Work {
 public:
  DeviceSetup(EngineImpl& engine, int device) : engine_(engine), device_(device) {}
  void run(Communicator&, Timeline&) override {
    cuda::set_device(device_);
    engine_.devices().get(device_);
  }
  std::string describe() const override {
    return "communicator setup for CUDA device " + std::to_string(device_);
  }

 private:
  EngineImpl& engine_;
  int device_;
};

}  // namespace

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
    if (current_bucket_ != kNotStarted) out << reducer_.describe(flight_, current_bucket_);
    return out.str();
  }

 private:
  static constexpr size_t kNotStarted = static_cast<size_t>(-1);
  ReducerImpl& reducer_;
  Flight& flight_;
  size_t current_bucket_ = kNotStarted;  // written and read on the scheduler thread
};

// The preview lane's view of one iteration (ReducerOptions::preview).
class ReducerImpl::PreviewWork final : public hemiola::Work {
 public:
  PreviewWork(ReducerImpl& reducer, Flight& flight) : reducer_(reducer), flight_(flight) {}
  void run(Communicator& comm, Timeline& timeline) override {
    reducer_.run_preview(flight_, comm, timeline);
  }
  std::string describe() const override {
    return "gradient preview of iteration " + std::to_string(flight_.iteration);
  }

 private:
  ReducerImpl& reducer_;
  Flight& flight_;
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
  observed_.assign(specs_.size(), 0);
  build(reverse_order(specs_.size()));
  if (on_device()) {
    // The device's stream and communicator are made now, on the scheduler
    // thread (a collective, in submission order), rather than inside the
    // first iteration: NCCL's initialisation synchronises the device, and
    // its errors belong to wrap time.
    engine_.submit(std::make_shared<DeviceSetup>(engine_, options_.device.index)).wait();
  }
}

ReducerImpl::~ReducerImpl() {
  // Iteration work refers to our flights: never let it outlive us.
  abort("reducer destroyed");
  for (auto& flight : flights_) {
    if (flight->handle.valid()) flight->handle.wait_for(std::chrono::hours(1));
    if (flight->preview && flight->preview->handle.valid()) {
      flight->preview->handle.wait_for(std::chrono::hours(1));
    }
  }
}

void ReducerImpl::build(const std::vector<size_t>& order) {
  plan_ = plan_buckets(specs_, order, options_.first_bucket_bytes, options_.fusion_bytes,
                       options_.partition_bytes);
  placement_.assign(specs_.size(), {});
  for (size_t b = 0; b < plan_.size(); ++b) {
    const PlannedBucket& bucket = plan_[b];
    for (size_t k = 0; k < bucket.tensors.size(); ++k) {
      placement_[bucket.tensors[k]].push_back(
          {b, bucket.offsets[k], bucket.begins[k], bucket.counts[k]});
    }
  }
  issue_order_.resize(plan_.size());
  for (size_t b = 0; b < plan_.size(); ++b) issue_order_[b] = b;
  flights_.clear();
  for (size_t f = 0; f < options_.in_flight + 1; ++f) {
    auto flight = std::make_unique<Flight>();
    if (on_device()) {
      flight->gpu = make_device_flight();
      for (const auto& buffer : flight->gpu->buffers) {
        flight->buffers.push_back(static_cast<unsigned char*>(buffer->data()));
      }
    } else {
      for (const auto& bucket : plan_) {
        // Zero-filled: unused slots and zero-element buckets read as zeros.
        flight->host_buffers.emplace_back(
            new unsigned char[std::max<size_t>(bucket.nbytes(), 1)]());
        flight->buffers.push_back(flight->host_buffers.back().get());
      }
    }
    flight->pending.reset(new std::atomic<int64_t>[plan_.size()]);
    flight->bucket_done.reset(new std::atomic<bool>[plan_.size()]);
    flight->state.reset(new std::atomic<uint8_t>[specs_.size()]);
    flight->out.assign(specs_.size(), nullptr);
    flight->usage.assign(specs_.size(), 0.0f);
    flight->queue = std::make_unique<ReadyQueue<uint32_t>>(plan_.size());
    if (options_.preview) {
      auto preview = std::make_unique<Preview>();
      for (const auto& bucket : plan_) {
        preview->codes.emplace_back(bucket.numel);
        preview->estimate.emplace_back(new unsigned char[std::max<size_t>(bucket.nbytes(), 1)]());
      }
      preview->queue = std::make_unique<ReadyQueue<uint32_t>>(plan_.size());
      preview->done.reset(new std::atomic<bool>[plan_.size()]);
      for (size_t b = 0; b < plan_.size(); ++b) preview->done[b].store(false);
      flight->preview = std::move(preview);
    }
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

std::unique_ptr<ReducerImpl::DeviceFlight> ReducerImpl::make_device_flight() const {
  const int device = options_.device.index;
  auto gpu = std::make_unique<DeviceFlight>();
  for (const auto& bucket : plan_) {
    // Zero-filled, as on the host.
    gpu->buffers.push_back(
        std::make_unique<cuda::DeviceBuffer>(device, std::max<size_t>(bucket.nbytes(), 1)));
    gpu->reduced.push_back(std::make_unique<cuda::Event>(device));
    const size_t slot_bytes = std::max<size_t>(bucket.tensors.size(), 1) * sizeof(cuda::FusionSlot);
    gpu->slots_host.push_back(std::make_unique<cuda::PinnedBuffer>(slot_bytes));
    gpu->slots_device.push_back(std::make_unique<cuda::DeviceBuffer>(device, slot_bytes));
  }
  gpu->uploaded.assign(plan_.size(), {});
  for (size_t i = 0; i < specs_.size(); ++i) {
    gpu->marked.push_back(std::make_unique<cuda::Event>(device));
  }
  gpu->done = std::make_unique<cuda::Event>(device);
  return gpu;
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
  if (flight.gpu) flight.gpu->fenced.store(kNoStream, std::memory_order_relaxed);
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
    preview->handle = engine_.submit_preview(std::make_shared<PreviewWork>(*this, flight));
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
  const size_t elem = dtype_size(spec.dtype);
  if (used) flight.out[index] = out;
  flight.usage[index] = used ? 1.0f : 0.0f;
  if (recording_.load(std::memory_order_relaxed)) {
    observed_[observed_count_.fetch_add(1, std::memory_order_relaxed)] = index;
  }
  if (flight.gpu) {
    copy_in_on_device(flight, index, source, used, stream);
  } else {
    for (const Placement& piece : placement_[index]) {
      unsigned char* dst = flight.buffers[piece.bucket] + piece.offset * elem;
      if (used) {
        std::memcpy(dst, static_cast<const unsigned char*>(source) + piece.begin * elem,
                    piece.count * elem);
      } else {
        std::memset(dst, 0, piece.count * elem);
      }
    }
  }
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

void ReducerImpl::copy_in_on_device(Flight& flight, size_t index, const void* source, bool used,
                                     void* stream) {
  DeviceFlight& gpu = *flight.gpu;
  const GradSpec& spec = specs_[index];
  if (used && recording_.load(std::memory_order_relaxed) && spec.numel > 0) {
    // First iteration only (the query costs a driver call): a host gradient
    // given to a CUDA reducer would otherwise fail inside a copy, unnamed.
    const int device = cuda::device_of(source);
    HEMIOLA_CHECK(device == options_.device.index, "gradient '", spec.name, "' is on ",
                  device < 0 ? std::string("the host") : "CUDA device " + std::to_string(device),
                  " but the reducer is on CUDA device ", options_.device.index,
                  "; every gradient of a model must be on the model's device");
  }
  // The caller's stream must not overwrite this flight's buffers while its
  // previous iteration may still read them: it waits for that, on the device,
  // once per iteration and stream.
  const auto id = reinterpret_cast<std::uintptr_t>(stream);
  if (gpu.fenced.exchange(id, std::memory_order_acq_rel) != id) gpu.done->block(stream);
  const size_t elem = dtype_size(spec.dtype);
  for (const Placement& piece : placement_[index]) {
    unsigned char* dst = flight.buffers[piece.bucket] + piece.offset * elem;
    if (used) {
      cuda::copy_async(dst, static_cast<const unsigned char*>(source) + piece.begin * elem,
                       piece.count * elem, stream);
    } else {
      cuda::zero_async(dst, piece.count * elem, stream);
    }
  }
  // Enqueued before the pending counts drop, so the scheduler, which may pop
  // the bucket right after, always finds the event recorded.
  gpu.marked[index]->record(stream);
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
                "for ", missing.size(), " tensor(s): ", join_names(specs_, missing),
                " (mark them ready or unused first)");
  if (recording_.load()) recording_.store(false);  // the first iteration is recorded
  marking_.store(nullptr, std::memory_order_release);
  return static_cast<int64_t>(flight->iteration);
}

void ReducerImpl::run(Flight& flight, Communicator& comm, Timeline& timeline,
                      size_t* current_bucket) {
  const size_t count = plan_.size();
  std::vector<bool> ready(count, false);
  DeviceCommunicator* device_comm = nullptr;
  void* stream = nullptr;  // the engine's communication stream (CUDA)
  if (flight.gpu) {
    cuda::set_device(options_.device.index);
    Devices::Entry& entry = engine_.devices().get(options_.device.index);
    device_comm = entry.comm.get();
    stream = entry.stream.get();
    check_previous_done(flight, *device_comm);
  }
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
    reduce(flight, b, comm, timeline, device_comm, stream);
  }
  *current_bucket = count;
  if (options_.track_usage) {
    comm.all_reduce_sum(TensorRef{flight.usage.data(), DType::kFloat32, flight.usage.size(), {}});
  }
  if (flight.gpu) {
    flight.gpu->done->record(stream);
    device_comm->check();
  }
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

void ReducerImpl::reduce(Flight& flight, size_t b, Communicator& comm, Timeline& timeline,
                         DeviceCommunicator* device_comm, void* stream) {
  const PlannedBucket& plan = plan_[b];
  unsigned char* buffer = flight.buffers[b];
  const int64_t start_us = timeline.now_us();
  if (flight.gpu) {
    reduce_on_device(flight, b, *device_comm, stream);
  } else {
    comm.all_reduce_sum(TensorRef{buffer, plan.dtype, plan.numel, Device{}});
    if (scale_ != 1.0) scale_in_place(plan.dtype, buffer, plan.numel, scale_);
    const size_t elem = dtype_size(plan.dtype);
    for (size_t k = 0; k < plan.tensors.size(); ++k) {
      auto* out = static_cast<unsigned char*>(flight.out[plan.tensors[k]]);
      if (out != nullptr) {
        std::memcpy(out + plan.begins[k] * elem, buffer + plan.offsets[k] * elem,
                    plan.counts[k] * elem);
      }
    }
    if (options_.preview) {
      // The next iteration's scales: the same on every rank, since the
      // averages are. (Before the bucket counts as done: the next
      // iteration's preview lane reads them once it is.)
      preview_scales(plan.dtype, buffer, plan.numel, preview_levels(engine_.options().world_size),
                     preview_scales_[b].data());
    }
    if (flight.preview && flight.preview->active) {
      double distance = 0.0;
      double norm = 0.0;
      preview_distance(plan.dtype, flight.preview->estimate[b].get(), buffer, plan.numel,
                       &distance, &norm);
      std::lock_guard<std::mutex> lock(preview_error_mutex_);
      preview_distance_ += distance;
      preview_norm_ += norm;
    }
  }
  {
    std::lock_guard<std::mutex> lock(flight.bucket_mutex);
    flight.bucket_done[b].store(true, std::memory_order_release);
  }
  flight.bucket_cv.notify_all();
  if (timeline.enabled()) {
    timeline.record("comm",
                    "allreduce bucket " + std::to_string(b) + " (iteration " +
                        std::to_string(flight.iteration) + ")",
                    "allreduce", start_us, timeline.now_us());
  }
}

void ReducerImpl::wait_previews(Flight& flight, Timeline& timeline) {
  Preview& preview = *flight.preview;
  const int64_t start_us = timeline.now_us();
  for (size_t b = 0; b < plan_.size(); ++b) {
    if (!wait_for_flag(preview.mutex, preview.cv, preview.done[b], preview.handle)) {
      HEMIOLA_THROW(ErrorCode::kAborted, "the preview of iteration ", flight.iteration,
                    " failed (see the error of its lane)");
    }
  }
  if (timeline.enabled() && timeline.now_us() - start_us > 1) {
    timeline.record("comm", "wait previews", "wait", start_us, timeline.now_us());
  }
}

void ReducerImpl::run_preview(Flight& flight, Communicator& comm, Timeline& timeline) {
  Preview& preview = *flight.preview;
  const int world = engine_.options().world_size;
  const int levels = preview_levels(world);
  std::vector<bool> ready(plan_.size(), false);
  for (size_t b : issue_order_) {
    wait_ready(*preview.queue, b, ready, timeline, "preview");
    wait_reduced(flight.iteration - 1, b);  // its average gives the scales
    const PlannedBucket& plan = plan_[b];
    const int64_t start_us = timeline.now_us();
    int8_t* codes = preview.codes[b].data();
    unsigned char* estimate = preview.estimate[b].get();
    const float* scales = preview_scales_[b].data();
    // The bucket still holds this rank's own gradients: the main lane
    // reduces it only once the whole preview is done.
    preview_encode(plan.dtype, flight.buffers[b], 0, plan.numel, scales, levels, codes, estimate);
    // uint8 sums wrap modulo 256, which is exact for int8 codes whose true
    // sum fits an int8 (|sum| <= world * levels <= 127).
    comm.all_reduce_sum(TensorRef{codes, DType::kUInt8, plan.numel, Device{}});
    preview_decode(plan.dtype, codes, 0, plan.numel, scales, world, estimate);
    {
      std::lock_guard<std::mutex> lock(preview.mutex);
      preview.done[b].store(true, std::memory_order_release);
    }
    preview.cv.notify_all();
    if (timeline.enabled()) {
      timeline.record("preview",
                      "preview bucket " + std::to_string(b) + " (iteration " +
                          std::to_string(flight.iteration) + ")",
                      "preview", start_us, timeline.now_us());
    }
  }
}

void ReducerImpl::wait_reduced(uint64_t iteration, size_t b) {
  Flight& previous = *flights_[iteration % flights_.size()];
  // Reused since (in_flight = 0 reuses it at once): that iteration is done.
  if (previous.iteration != iteration) return;
  if (!wait_for_flag(previous.bucket_mutex, previous.bucket_cv, previous.bucket_done[b],
                     previous.handle)) {
    HEMIOLA_THROW(ErrorCode::kTimeout, "the preview of iteration ", iteration + 1,
                  " waited in vain for iteration ", iteration, "'s bucket ", b,
                  " (its reduction failed)");
  }
}

void ReducerImpl::reduce_on_device(Flight& flight, size_t b, DeviceCommunicator& comm,
                                   void* stream) {
  DeviceFlight& gpu = *flight.gpu;
  const PlannedBucket& plan = plan_[b];
  // The engine's stream waits, on the device, for every copy into the bucket.
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    if (k == 0 || plan.tensors[k] != plan.tensors[k - 1]) gpu.marked[plan.tensors[k]]->block(stream);
  }
  comm.all_reduce(TensorRef{flight.buffers[b], plan.dtype, plan.numel, options_.device},
                  options_.average, stream);
  // Averaged in the reduction itself; results with an output go there in one
  // unpack launch.
  const size_t elem = dtype_size(plan.dtype);
  std::vector<void*> outs;
  std::vector<cuda::FusionSlot> slots;
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    auto* out = static_cast<unsigned char*>(flight.out[plan.tensors[k]]);
    if (out == nullptr) continue;
    outs.push_back(out);
    slots.push_back({out + plan.begins[k] * elem, static_cast<std::int64_t>(plan.offsets[k]),
                     static_cast<std::int64_t>(plan.counts[k])});
  }
  if (!slots.empty()) {
    if (outs != gpu.uploaded[b]) {
      // The pinned slots may still be read by this flight's previous upload.
      if (!gpu.done->wait_for(timeout())) {
        HEMIOLA_THROW(ErrorCode::kTimeout, "an earlier iteration's reductions did not complete "
                      "on CUDA device ", options_.device.index, " within ",
                      engine_.options().timeout_s, " s");
      }
      const size_t bytes = slots.size() * sizeof(cuda::FusionSlot);
      std::memcpy(gpu.slots_host[b]->data(), slots.data(), bytes);
      cuda::copy_async(gpu.slots_device[b]->data(), gpu.slots_host[b]->data(), bytes, stream);
      gpu.uploaded[b] = outs;
    }
    const cuda::FusionSlot& last = slots.back();
    cuda::unpack(static_cast<const cuda::FusionSlot*>(gpu.slots_device[b]->data()),
                 static_cast<std::int64_t>(slots.size()), last.offset + last.numel, plan.dtype,
                 flight.buffers[b], 1.0, stream);
  }
  gpu.reduced[b]->record(stream);
}

void ReducerImpl::check_previous_done(const Flight& flight, DeviceCommunicator& comm) const {
  comm.check();
  if (flight.iteration == 0) return;
  const Flight& previous = *flights_[(flight.iteration - 1) % flights_.size()];
  if (!previous.gpu->done->wait_for(timeout())) {
    comm.check();  // an NCCL error, if there is one, says more than the timeout
    comm.abort();
    HEMIOLA_THROW(ErrorCode::kTimeout, "the reductions of iteration ", flight.iteration - 1,
                  " did not complete on CUDA device ", options_.device.index, " within ",
                  engine_.options().timeout_s, " s (", comm.name(),
                  "): a rank died or stalled, or the device hangs");
  }
}

std::string ReducerImpl::describe(const Flight& flight, size_t position) const {
  std::ostringstream out;
  const size_t count = plan_.size();
  if (position >= count) {
    out << ", at the usage all-reduce after all " << count << " buckets";
    return out.str();
  }
  const size_t b = issue_order_[position];
  const PlannedBucket& plan = plan_[b];
  out << ", at bucket " << b << " (" << position + 1 << " of " << count << " in issue order; "
      << dtype_name(plan.dtype) << ", " << plan.nbytes()
      << " bytes; parameters: " << join_names(specs_, plan.tensors) << ")";
  if (position + 1 < count) {
    std::vector<size_t> rest;
    for (size_t p = position + 1; p < count; ++p) {
      for (size_t t : plan_[issue_order_[p]].tensors) rest.push_back(t);
    }
    out << "; still pending after it: " << count - position - 1
        << " bucket(s) (parameters: " << join_names(specs_, rest, 4) << ")";
  }
  (void)flight;
  return out.str();
}

void ReducerImpl::wait(uint64_t iteration, void* stream) {
  Handle handle;
  const DeviceFlight* gpu = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HEMIOLA_CHECK(iteration < started_.load(), "iteration ", iteration, " has not started");
    const Flight& flight = *flights_[iteration % flights_.size()];
    if (flight.iteration != iteration) return;  // reused: it completed long ago
    HEMIOLA_CHECK(marking_.load() != &flight, "wait(", iteration,
                  ") while its gradients are still being marked; call finish_marking() first");
    handle = flight.handle;
    gpu = flight.gpu.get();
  }
  handle.wait();
  if (gpu) gpu->done->block(stream);
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
  if (flight->gpu) flight->gpu->reduced[bucket]->block(stream);
}

bool ReducerImpl::bucket_done(uint64_t iteration, size_t bucket) const {
  HEMIOLA_CHECK(bucket < plan_.size(), "bucket ", bucket, " is out of range");
  if (iteration >= started_.load()) return false;
  const Flight& flight = *flights_[iteration % flights_.size()];
  if (flight.iteration != iteration) return true;  // reused: it completed long ago
  // On CUDA: enqueued, and complete on the device.
  return flight.bucket_done[bucket].load(std::memory_order_acquire) &&
         (!flight.gpu || flight.gpu->reduced[bucket]->query());
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
                "') is not reduced yet; call wait() or wait_bucket() first");
  const GradSpec& spec = specs_[index];
  return TensorRef{flight.buffers[where.bucket] + where.offset * dtype_size(spec.dtype),
                   spec.dtype, spec.numel, options_.device};
}

bool ReducerImpl::preview_done(uint64_t iteration, size_t bucket) const {
  HEMIOLA_CHECK(bucket < plan_.size(), "bucket ", bucket, " is out of range");
  if (iteration >= started_.load()) return false;
  const Flight& flight = *flights_[iteration % flights_.size()];
  return flight.preview && flight.iteration == iteration &&
         flight.preview->done[bucket].load(std::memory_order_acquire);
}

void ReducerImpl::wait_preview(uint64_t iteration, size_t bucket) {
  HEMIOLA_CHECK(bucket < plan_.size(), "bucket ", bucket, " is out of range");
  Flight* flight;
  Handle handle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HEMIOLA_CHECK(iteration < started_.load(), "iteration ", iteration, " has not started");
    flight = flights_[iteration % flights_.size()].get();
    if (flight->iteration != iteration || !flight->preview || !flight->preview->active) return;
    HEMIOLA_CHECK(marking_.load() != flight, "wait_preview(", iteration,
                  ") while its gradients are still being marked");
    handle = flight->preview->handle;
  }
  Preview& preview = *flight->preview;
  if (!wait_for_flag(preview.mutex, preview.cv, preview.done[bucket], handle)) handle.wait();
}

TensorRef ReducerImpl::preview(uint64_t iteration, size_t index) const {
  HEMIOLA_CHECK(index < specs_.size(), "gradient index ", index, " is out of range");
  HEMIOLA_CHECK(placement_[index].size() == 1, "gradient '", specs_[index].name,
                "' is partitioned across ", placement_[index].size(),
                " buckets; it has no contiguous preview");
  const Placement& where = placement_[index].front();
  HEMIOLA_CHECK(preview_done(iteration, where.bucket), "iteration ", iteration, "'s bucket ",
                where.bucket, " ('", specs_[index].name, "') has no preview (yet)");
  const Flight& flight = *flights_[iteration % flights_.size()];
  const GradSpec& spec = specs_[index];
  return TensorRef{flight.preview->estimate[where.bucket].get() +
                       where.offset * dtype_size(spec.dtype),
                   spec.dtype, spec.numel, options_.device};
}

double ReducerImpl::preview_error() const {
  std::lock_guard<std::mutex> lock(preview_error_mutex_);
  return preview_norm_ > 0.0 ? std::sqrt(preview_distance_ / preview_norm_) : 0.0;
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
void Reducer::wait_bucket(uint64_t iteration, size_t bucket, StreamRef stream) {
  impl_->wait_bucket(iteration, bucket, stream.handle);
}
bool Reducer::bucket_done(uint64_t iteration, size_t bucket) const {
  return impl_->bucket_done(iteration, bucket);
}
void Reducer::set_issue_order(const std::vector<size_t>& order) { impl_->set_issue_order(order); }
std::vector<size_t> Reducer::issue_order() const { return impl_->issue_order(); }
void Reducer::abort(const std::string& reason) { impl_->abort(reason); }
TensorRef Reducer::result(uint64_t iteration, size_t index) const {
  return impl_->result(iteration, index);
}
std::vector<int> Reducer::usage(uint64_t iteration) const { return impl_->usage(iteration); }
bool Reducer::preview_done(uint64_t iteration, size_t bucket) const {
  return impl_->preview_done(iteration, bucket);
}
void Reducer::wait_preview(uint64_t iteration, size_t bucket) {
  impl_->wait_preview(iteration, bucket);
}
TensorRef Reducer::preview(uint64_t iteration, size_t index) const {
  return impl_->preview(iteration, index);
}
double Reducer::preview_error() const { return impl_->preview_error(); }
std::vector<std::vector<size_t>> Reducer::buckets() const { return impl_->buckets(); }
std::vector<size_t> Reducer::observed_order() const { return impl_->observed_order(); }
size_t Reducer::pieces(size_t index) const { return impl_->pieces(index); }
const ReducerOptions& Reducer::options() const { return impl_->options(); }
void Reducer::rebuild_from_observed_order() { impl_->rebuild_from_observed_order(); }
void Reducer::rebuild(const std::vector<size_t>& order) { impl_->rebuild(order); }
uint64_t Reducer::iterations_started() const { return impl_->iterations_started(); }

}  // namespace hemiola
