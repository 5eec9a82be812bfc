// What the two schedules of hemiola/updater.h do differently, behind one
// small interface chosen once when the Updater is made: when an iteration's
// updates land (step(), at a gate, all at once) and what the live
// parameters hold in between. Both work on the shared LandingGraph
// (engine/updater/landing_graph.h), which must outlive them.
//
//   priority (priority_policy.cpp): one pending iteration; a parameter is
//     written only if no forward read it since step(), or when a gate
//     needs it.
//   decoupled (decoupled_policy.cpp): up to in_flight pending iterations and
//     a shadow of exact parameters; the live ones hold the shadow stepped with
//     this rank's own gradients (or a preview's estimate,
//     engine/updater/preview_landing.h) until the exact steps land.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/reducer/mark_observer.h"
#include "engine/updater/landing_graph.h"
#include "hemiola/update_types.h"

namespace hemiola {

// A policy observes the reducer's marks (the Updater registers it): what it
// keeps of a mark (decoupled: the local gradient) or refuses (priority: a
// parameter read before its update landed).
class UpdatePolicy : public MarkObserver {
 public:
  ~UpdatePolicy() override = default;

  // The graph adopted new parameters (nothing is pending): take what the
  // schedule keeps per parameter from them.
  virtual void adopt() = 0;
  // optimizer.step() after the backward of `iteration` (reads cleared).
  virtual void step(uint64_t iteration, const StepOptions& options) = 0;
  // The forward reaches a gate that reads `needed` (marked read after).
  virtual void land(const std::vector<size_t>& needed, bool training) = 0;
  // Lands everything pending (waits), on the current stream.
  virtual void land_all() = 0;
  // See Updater::approximate_read_fraction / preview_read_fraction.
  virtual double approximate_read_fraction() const = 0;
  virtual double preview_read_fraction() const = 0;
};

std::unique_ptr<UpdatePolicy> make_priority_policy(LandingGraph& graph,
                                                   const UpdaterOptions& options);
std::unique_ptr<UpdatePolicy> make_decoupled_policy(LandingGraph& graph,
                                                    const UpdaterOptions& options);

}  // namespace hemiola
