// decoupled's preview (ReducerOptions::preview): each bucket coded in one
// byte (engine/codec/preview.h), summed on a wire of its own ahead of the
// full reduction, and each rank's estimate of the average made from it.
// Host memory only.
//
// How it sits beside the full reduction, which knows nothing of it:
//   - it works from the second iteration of a bucket plan on (its scales
//     come from the previous iteration's averages, reduced under the same
//     plan); its step on bucket b waits until the previous iteration
//     reduced b;
//   - it observes the full reduction: as each bucket is averaged, it takes
//     the next iteration's scales (the same on every rank, since the
//     averages are) and this iteration's preview error from it;
//   - the full reduction gates on it (waits for every preview of an
//     iteration first): the previews are what the next forward needs first,
//     and the full reductions have the whole next iteration to run, so they
//     do not compete with it for the network. The full reduction leaves the
//     packed gradients alone until then, which is what the previews code.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/reducer/lane.h"

namespace hemiola {

class PreviewLane final : public Lane {
 public:
  // Connects its wire (a rendezvous: at the same point on every rank).
  // Observes `reduction` and must be added to the ring before it.
  PreviewLane(const IterationRing& ring, const ReducerPlan& plan, Scheduler& host,
              Lane& reduction);

  // Unlike the full reduction's, false for an iteration whose flight was
  // reused: its estimates are gone.
  bool done(uint64_t iteration, size_t bucket) const override;
  // This rank's estimate of the average of gradient `index`.
  TensorRef value(uint64_t iteration, size_t index) const override;
  // How far this rank's previews were from the averages they estimate, over
  // every previewed bucket so far: sqrt(sum |estimate - average|^2 /
  // sum |average|^2) (0 before the first).
  double error() const;

  void release(const InFlightIteration& flight, uint64_t next) const override;

 protected:
  void on_rebuild(size_t flights) override;
  bool takes(const InFlightIteration& flight) const override;
  void step(InFlightIteration& flight, size_t bucket, Communicator& comm,
            Timeline& timeline) override;

 private:
  // The full reduction averaged bucket `bucket` of `flight`.
  void averaged(InFlightIteration& flight, size_t bucket);

  // Per flight slot, per bucket in plan layout: the codes (all-reduced in
  // place into their sums) and the estimate (the bucket's dtype).
  struct Buffers {
    std::vector<std::vector<int8_t>> codes;
    std::vector<std::unique_ptr<unsigned char[]>> estimate;
  };

  Lane& reduction_;
  std::vector<Buffers> buffers_;
  // Per bucket, one scale per kPreviewBlock elements, from the newest
  // averaged gradient (written by the full reduction's thread as each bucket
  // is reduced; iteration k's preview reads bucket b's after iteration k - 1
  // reduced it, and iteration k's full reduction writes them only after k's
  // previews are done). Every rank has the same ones.
  std::vector<std::vector<float>> scales_;
  // Summed over every previewed bucket so far, as each is fully reduced:
  // squared distance of this rank's estimate from the average, and the
  // average's squared norm (error()).
  mutable std::mutex error_mutex_;
  double distance_ = 0.0;
  double norm_ = 0.0;
};

}  // namespace hemiola
