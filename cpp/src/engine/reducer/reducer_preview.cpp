// The reducer's preview lane (ReducerOptions::preview): a one-byte coding of
// each bucket, summed on a lane of its own ahead of the full-precision
// reduction, and each rank's estimate of the average made from it
// (engine/preview.h has the coding; docs/schedules.md why). Host memory only.
#include <cmath>
#include <mutex>
#include <string>

#include "engine/codec/preview.h"
#include "engine/reducer/reducer_impl.h"
#include "hemiola/status.h"

namespace hemiola {

// The preview lane's view of one iteration.
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

std::unique_ptr<ReducerImpl::Preview> ReducerImpl::make_preview() const {
  auto preview = std::make_unique<Preview>();
  for (const auto& bucket : plan_) {
    preview->codes.emplace_back(bucket.numel);
    preview->estimate.emplace_back(new unsigned char[std::max<size_t>(bucket.nbytes(), 1)]());
  }
  preview->queue = std::make_unique<ReadyQueue<uint32_t>>(plan_.size());
  preview->done.reset(new std::atomic<bool>[plan_.size()]);
  for (size_t b = 0; b < plan_.size(); ++b) preview->done[b].store(false);
  return preview;
}

Handle ReducerImpl::submit_preview(Flight& flight) {
  return engine_.submit_preview(std::make_shared<PreviewWork>(*this, flight));
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
    preview_encode(plan.dtype, flight.storage->buffer(b), 0, plan.numel, scales, levels, codes,
                   estimate);
    // uint8 sums wrap modulo 256, which is exact for int8 codes whose true
    // sum fits an int8 (|sum| <= world * levels <= 127).
    comm.all_reduce_sum(TensorRef{codes, DType::kUInt8, plan.numel, Device{}});
    preview_decode(plan.dtype, codes, 0, plan.numel, scales, world, estimate);
    set_flag(preview.mutex, preview.cv, preview.done[b]);
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

void ReducerImpl::after_reduced(Flight& flight, size_t b) {
  const PlannedBucket& plan = plan_[b];
  const unsigned char* average = flight.storage->buffer(b);
  // The next iteration's scales: the same on every rank, since the averages
  // are. (Before the bucket counts as done: the next iteration's preview
  // lane reads them once it is.)
  preview_scales(plan.dtype, average, plan.numel, engine_.options().world_size,
                 preview_scales_[b].data());
  if (!flight.preview->active) return;
  double distance = 0.0;
  double norm = 0.0;
  preview_distance(plan.dtype, flight.preview->estimate[b].get(), average, plan.numel, &distance,
                   &norm);
  std::lock_guard<std::mutex> lock(preview_error_mutex_);
  preview_distance_ += distance;
  preview_norm_ += norm;
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

}  // namespace hemiola
