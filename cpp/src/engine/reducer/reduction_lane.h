// The full reduction: each packed bucket all-reduced on the engine's main
// wire (through its coding, when compressed) and written to its outputs.
// This is the lane every schedule has; its results are the averaged
// gradients.
#pragma once

#include <string>

#include "engine/reducer/lane.h"

namespace hemiola {

class ReductionLane final : public Lane {
 public:
  // `device`: where the buckets live. `track_usage`: after the last bucket, sum over ranks which tensors each
  // rank produced (ReducerOptions::track_usage).
  ReductionLane(const IterationRing& ring, const ReducerPlan& plan, LaneHost& host,
                const Device& device, bool track_usage);

  TensorRef value(uint64_t iteration, size_t index) const override;

 protected:
  void before(Flight& flight, Communicator& comm, Timeline& timeline) override;
  void step(Flight& flight, size_t bucket, Communicator& comm, Timeline& timeline) override;
  void after(Flight& flight, Communicator& comm, Timeline& timeline) override;
  std::string where(const Flight& flight, size_t position) const override;
  bool complete_on_device(const Flight& flight, size_t bucket) const override;
  void wait_on_device(const Flight& flight, size_t bucket, void* stream) const override;

 private:
  const Device device_;
  const bool track_usage_;
};

}  // namespace hemiola
