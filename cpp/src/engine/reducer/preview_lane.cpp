// The preview lane (see preview_lane.h; engine/codec/preview.h has the coding,
// docs/schedules.md why).
#include "engine/reducer/preview_lane.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/dtype_math.h"
#include "engine/codec/preview.h"
#include "hemiola/status.h"

namespace hemiola {

PreviewLane::PreviewLane(const IterationRing& ring, const ReducerPlan& plan, Scheduler& host,
                         Lane& reduction)
    : Lane("preview", "gradient preview", ring, plan, host, host.connect_wire("preview")),
      reduction_(reduction) {
  reduction_.observe([this](InFlightIteration& flight, size_t b) { averaged(flight, b); });
}

void PreviewLane::on_rebuild(size_t flights) {
  buffers_.clear();
  buffers_.resize(flights);
  for (Buffers& buffers : buffers_) {
    for (const auto& bucket : plan_.buckets) {
      buffers.codes.emplace_back(bucket.numel);
      buffers.estimate.emplace_back(new unsigned char[std::max<size_t>(bucket.nbytes(), 1)]());
    }
  }
  scales_.clear();
  for (const auto& bucket : plan_.buckets) {
    scales_.emplace_back((bucket.numel + kPreviewBlock - 1) / kPreviewBlock, 0.0f);
  }
}

bool PreviewLane::takes(const InFlightIteration& flight) const {
  // The scales come from the previous iteration, reduced under this plan.
  return flight.iteration > plan_.first_iteration;
}

void PreviewLane::release(const InFlightIteration& flight, uint64_t next) const {
  Lane::release(flight, next);
  if (next == 0) return;
  // The previous iteration's preview reads the flight reused now (its
  // scales' iteration's reduction): it must be done first. It needs nothing
  // more than what has happened already, so this is short.
  const Handle& previous = handle(ring_.flight_for(next - 1).slot);
  if (previous.valid()) previous.wait();
}

void PreviewLane::step(InFlightIteration& flight, size_t b, Communicator& comm,
                       Timeline& timeline) {
  const int world = host_.options().world_size;
  // Its average gives the scales.
  if (!reduction_.await(flight.iteration - 1, b)) {
    HEMIOLA_THROW(ErrorCode::kTimeout, "the preview of iteration ", flight.iteration,
                  " waited in vain for iteration ", flight.iteration - 1, "'s bucket ", b,
                  " (its reduction failed)");
  }
  const PlannedBucket& bucket = plan_.buckets[b];
  const int64_t start_us = timeline.now_us();
  Buffers& buffers = buffers_[flight.slot];
  int8_t* codes = buffers.codes[b].data();
  unsigned char* estimate = buffers.estimate[b].get();
  const float* scales = scales_[b].data();
  // The bucket still holds this rank's own gradients: the full reduction
  // gates on this lane.
  preview_encode(bucket.dtype, flight.storage->buffer(b), 0, bucket.numel, scales,
                 preview_levels(world), codes, estimate);
  // uint8 sums wrap modulo 256, which is exact for int8 codes whose true
  // sum fits an int8 (|sum| <= world * levels <= 127).
  comm.all_reduce_sum(TensorRef{codes, DType::kUInt8, bucket.numel, Device{}});
  preview_decode(bucket.dtype, codes, 0, bucket.numel, scales, world, estimate);
  if (timeline.enabled()) {
    timeline.record(timeline_lane(),
                    "preview bucket " + std::to_string(b) + " (iteration " +
                        std::to_string(flight.iteration) + ")",
                    "preview", start_us, timeline.now_us());
  }
}

void PreviewLane::averaged(InFlightIteration& flight, size_t b) {
  const PlannedBucket& bucket = plan_.buckets[b];
  const unsigned char* average = flight.storage->buffer(b);
  // The next iteration's scales (before the bucket counts as done: the next
  // iteration's preview reads them once it is).
  preview_scales(bucket.dtype, average, bucket.numel, host_.options().world_size,
                 scales_[b].data());
  if (!active(flight.iteration)) return;
  double distance = 0.0;
  double norm = 0.0;
  preview_distance(bucket.dtype, buffers_[flight.slot].estimate[b].get(), average, bucket.numel,
                   &distance, &norm);
  std::lock_guard<std::mutex> lock(error_mutex_);
  distance_ += distance;
  norm_ += norm;
}

bool PreviewLane::done(uint64_t iteration, size_t bucket) const {
  HEMIOLA_CHECK(bucket < plan_.buckets.size(), "bucket ", bucket, " is out of range");
  if (iteration >= ring_.started()) return false;
  const InFlightIteration& flight = ring_.flight_for(iteration);
  return flight.iteration == iteration && active(iteration) && flagged(flight, bucket);
}

TensorRef PreviewLane::value(uint64_t iteration, size_t index) const {
  const Placement& where = whole(index, "; it has no contiguous preview");
  const GradSpec& spec = plan_.specs[index];
  HEMIOLA_CHECK(done(iteration, where.bucket), "iteration ", iteration, "'s bucket ",
                where.bucket, " ('", spec.name, "') has no preview (yet)");
  const InFlightIteration& flight = ring_.flight_for(iteration);
  return TensorRef{buffers_[flight.slot].estimate[where.bucket].get() +
                       where.offset * dtype_size(spec.dtype),
                   spec.dtype, spec.numel, Device{}};
}

double PreviewLane::error() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return norm_ > 0.0 ? std::sqrt(distance_ / norm_) : 0.0;
}

}  // namespace hemiola
