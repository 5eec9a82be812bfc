// The streaming schedule's internals (hemiola/streamer.h has the contract):
// the fragments, the shared copy and the outer optimizer's state in fragment
// layout, and the one fragment in flight (the fragment averager's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/buckets/bucket_plan.h"
#include "engine/buckets/bucket_storage.h"
#include "engine/wire/scheduler.h"
#include "engine/streaming/fragment_averager.h"
#include "hemiola/handle.h"
#include "hemiola/streamer.h"

namespace hemiola {

class StreamerImpl {
 public:
  // `group`: this rank's replica group, or null (fragment_averager.h).
  StreamerImpl(Scheduler& scheduler, std::vector<StreamedParameter> params,
               const StreamerOptions& options, Scheduler* group = nullptr);
  ~StreamerImpl();

  void after_inner_step();
  void finish_step();
  void rejoin(Scheduler& across, bool redo);
  void adopt(uint64_t inner_steps, uint64_t syncs, const std::vector<uint8_t>& momentum_started);
  bool in_flight_averaged() const {
    return in_flight_ && (averaged_ || averager_->averaged_before_failure());
  }
  uint64_t in_flight_round() const { return syncs_; }
  void offer(uint64_t epoch) { averager_->offer(epoch); }
  uint64_t agreed_offer() const { return agreed_; }
  std::vector<size_t> next_step_fragments() const;
  uint64_t inner_steps() const { return steps_; }
  void wait_in_flight();
  double waited_ms() const { return waited_ms_; }
  double host_ms() const { return host_ms_; }
  uint64_t syncs() const { return syncs_; }
  TensorRef shared(size_t fragment);
  TensorRef outer_momentum(size_t fragment);
  TensorRef residual(size_t index);
  int64_t in_flight_fragment() const { return in_flight_ ? static_cast<int64_t>(sent_) : -1; }
  uint64_t in_flight_step() const { return sent_step_; }
  TensorRef in_flight_average();
  TensorRef in_flight_base();
  void restore(uint64_t inner_steps, const std::vector<uint8_t>& momentum_started,
               int64_t in_flight_fragment, uint64_t in_flight_step);
  std::vector<uint8_t> momentum_started() const;
  std::vector<std::vector<size_t>> fragments() const;
  const StreamerOptions& options() const { return options_; }

 private:
  // Per fragment, in its plan layout: the shared copy and the outer
  // momentum (the parameters' dtype).
  struct Fragment {
    std::unique_ptr<unsigned char[]> shared;
    std::unique_ptr<unsigned char[]> momentum;
    bool momentum_started = false;  // false: the next outer step creates it
  };

  // Whether fragment `f` is sent after inner step `step`.
  bool due(size_t f, uint64_t step) const;
  // Packs the live values of fragment `f` into `out` (its plan layout),
  // and the other way: the live values of fragment `f` from `in`.
  void pack(size_t f, unsigned char* out) const;
  void unpack(size_t f, const unsigned char* in);
  // Sends fragment `f`'s pseudo-gradient (shared - live) to be averaged.
  void send(size_t f);
  // Submits the fragment in flight's pseudo-gradient (shared - base).
  void submit_in_flight();
  std::unique_ptr<FragmentAverager> make_averager(Scheduler& scheduler) const;
  // Waits for the fragment in flight; its outer step and merge.
  void land();
  // check_finite: throws unless fragment f's average (in average_) is finite.
  void check_finite(size_t f) const;
  // Fragment `f`'s values in `data` (laid out as its plan).
  TensorRef buffer(size_t f, unsigned char* data) const;

  Scheduler* scheduler_;  // the wire between replicas (rejoin() moves it)
  Scheduler* const group_;  // this rank's replica group, or null
  const std::vector<StreamedParameter> params_;
  const StreamerOptions options_;
  std::vector<GradSpec> specs_;
  std::vector<PlannedBucket> plan_;
  std::vector<std::vector<Placement>> placement_;
  std::vector<Fragment> fragments_;
  std::unique_ptr<FragmentAverager> averager_;

  uint64_t steps_ = 0;
  bool step_finished_ = true;  // after_inner_step(steps_) ran to its end
  uint64_t syncs_ = 0;
  uint64_t agreed_ = 0;  // the last landed average's agreed offer
  double waited_ms_ = 0.0;
  double host_ms_ = 0.0;  // in after_inner_step(), less the waits
  // The fragment in flight (one at a time): its number, the step it was sent
  // after, the live values it was sent from and, once the averager handed it
  // back, its averaged pseudo-gradient (each the largest fragment's size).
  bool in_flight_ = false;
  bool averaged_ = false;  // the handle is done: average_ holds the average
  size_t sent_ = 0;
  uint64_t sent_step_ = 0;
  Handle handle_;
  std::unique_ptr<unsigned char[]> base_;
  std::unique_ptr<unsigned char[]> average_;
};

}  // namespace hemiola
