// The full reduction lane, and what its errors name: the tensors and buckets
// a failed or stalled reduction was at, so that a timeout on one rank points
// at the layer whose gradient never came.
#include "engine/reducer/reduction_lane.h"

#include <sstream>

#include "hemiola/status.h"

namespace hemiola {

ReductionLane::ReductionLane(const IterationRing& ring, const ReducerPlan& plan, Scheduler& host,
                             const Device& device, bool track_usage)
    : Lane("comm", "gradient reduction", ring, plan, host, Scheduler::kMainWire),
      device_(device), track_usage_(track_usage) {}

void ReductionLane::before(InFlightIteration& flight, Communicator&, Timeline&) {
  const BucketStorage* previous =
      flight.iteration == 0 ? nullptr : ring_.flight_for(flight.iteration - 1).storage.get();
  flight.storage->begin_reductions(flight.iteration, previous);
}

void ReductionLane::step(InFlightIteration& flight, size_t b, Communicator& comm,
                         Timeline& timeline) {
  const int64_t start_us = timeline.now_us();
  codec_->reduce(*flight.storage, b, flight.iteration, flight.out, comm);
  if (timeline.enabled()) {
    timeline.record(timeline_lane(),
                    "allreduce bucket " + std::to_string(b) + " (iteration " +
                        std::to_string(flight.iteration) + ")",
                    "allreduce", start_us, timeline.now_us());
  }
}

void ReductionLane::after(InFlightIteration& flight, Communicator& comm, Timeline&) {
  if (track_usage_) {
    comm.all_reduce_sum(TensorRef{flight.usage.data(), DType::kFloat32, flight.usage.size(), {}});
  }
  flight.storage->end_reductions();
}

bool ReductionLane::complete_on_device(const InFlightIteration& flight, size_t bucket) const {
  return flight.storage->reduced(bucket);
}

void ReductionLane::wait_on_device(const InFlightIteration& flight, size_t bucket,
                                   void* stream) const {
  flight.storage->block_until_reduced(bucket, stream);
}

void ReductionLane::wait_iteration_on_device(const InFlightIteration& flight, void* stream) const {
  flight.storage->block_until_done(stream);
}

std::vector<int> ReductionLane::usage(uint64_t iteration) const {
  HEMIOLA_CHECK(track_usage_, "usage() needs ReducerOptions::track_usage");
  const InFlightIteration& flight = ring_.flight_for(iteration);
  HEMIOLA_CHECK(iteration < ring_.started() && flight.iteration == iteration, "iteration ",
                iteration, "'s results are gone (its buffers were reused by a later iteration)");
  HEMIOLA_CHECK(ring_.marking_flight() != &flight && handle(flight.slot).done(), "iteration ",
                iteration, " is not reduced yet; call wait(", iteration, ") first");
  std::vector<int> out(flight.usage.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int>(flight.usage[i] + 0.5f);
  return out;
}

TensorRef ReductionLane::value(uint64_t iteration, size_t index) const {
  const Placement& where =
      whole(index, ", so its result is not contiguous here: pass an output to mark_ready");
  const GradSpec& spec = plan_.specs[index];
  const InFlightIteration& flight = ring_.flight_for(iteration);
  HEMIOLA_CHECK(iteration < ring_.started() && flight.iteration == iteration, "iteration ",
                iteration, "'s results are gone (its buffers were reused by a later iteration)");
  HEMIOLA_CHECK(flagged(flight, where.bucket), "iteration ", iteration, "'s bucket ",
                where.bucket, " ('", spec.name, "') is not reduced yet; wait for it first");
  return TensorRef{flight.storage->buffer(where.bucket) + where.offset * dtype_size(spec.dtype),
                   spec.dtype, spec.numel, device_};
}

std::string ReductionLane::where(const InFlightIteration&, size_t position) const {
  std::ostringstream out;
  const size_t count = plan_.buckets.size();
  if (position >= count) {
    out << ", at the usage all-reduce after all " << count << " buckets";
    return out.str();
  }
  const size_t b = plan_.issue_order[position];
  const PlannedBucket& bucket = plan_.buckets[b];
  out << ", at bucket " << b << " (" << position + 1 << " of " << count << " in issue order; "
      << dtype_name(bucket.dtype) << ", " << bucket.nbytes()
      << " bytes; parameters: " << ring_.names(bucket.tensors) << ")";
  if (position + 1 < count) {
    std::vector<size_t> rest;
    for (size_t p = position + 1; p < count; ++p) {
      for (size_t t : plan_.buckets[plan_.issue_order[p]].tensors) rest.push_back(t);
    }
    out << "; still pending after it: " << count - position - 1
        << " bucket(s) (parameters: " << ring_.names(rest, 4) << ")";
  }
  return out.str();
}

}  // namespace hemiola
