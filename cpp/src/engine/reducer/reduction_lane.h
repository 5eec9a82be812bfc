// The full reduction: each packed bucket all-reduced on the engine's main
// wire (through its coding, when compressed) and written to its outputs.
// This is the lane every schedule has; its results are the averaged
// gradients.
#pragma once

#include <string>

#include <memory>
#include <vector>

#include "engine/codec/codec.h"
#include "engine/reducer/lane.h"

namespace hemiola {

class ReductionLane final : public Lane {
 public:
  // `device`: where the buckets live. `track_usage`: after the last bucket, sum over ranks which tensors each
  // rank produced (ReducerOptions::track_usage).
  ReductionLane(const IterationRing& ring, const ReducerPlan& plan, Scheduler& host,
                const Device& device, bool track_usage);

  TensorRef value(uint64_t iteration, size_t index) const override;
  // ReducerOptions::track_usage: how many ranks used each tensor in
  // `iteration` (once its whole work is done: wait_iteration).
  std::vector<int> usage(uint64_t iteration) const;
  // How its buckets travel (ReducerOptions::compression): set before the
  // first iteration; used on the lane's thread only, one bucket at a time in
  // iteration order (so iteration t's residuals are written before t+1
  // reads them).
  void set_codec(std::unique_ptr<Codec> codec) { codec_ = std::move(codec); }
  Codec& codec() { return *codec_; }

 protected:
  void before(InFlightIteration& flight, Communicator& comm, Timeline& timeline) override;
  void step(InFlightIteration& flight, size_t bucket, Communicator& comm,
            Timeline& timeline) override;
  void after(InFlightIteration& flight, Communicator& comm, Timeline& timeline) override;
  std::string where(const InFlightIteration& flight, size_t position) const override;
  bool complete_on_device(const InFlightIteration& flight, size_t bucket) const override;
  void wait_on_device(const InFlightIteration& flight, size_t bucket, void* stream) const override;
  void wait_iteration_on_device(const InFlightIteration& flight, void* stream) const override;

 private:
  const Device device_;
  const bool track_usage_;
  std::unique_ptr<Codec> codec_;
};

}  // namespace hemiola
