// decoupled's preview landing (hemiola/updater.h, ReducerOptions::preview):
// a parameter is stepped again from the shadow with the preview's estimate
// of the average once its preview arrives (land() waits for it), and the
// exact steps land only in step(). Every forward then reads estimates, none a
// mix of exact back layers and approximate front ones.
//
// Invariants: the reducer's in_flight is 1, so the iteration previewed is the
// only one pending; a parameter takes its preview step at most once per
// iteration, only while its exact step has not landed, it took the local step,
// and no forward read it since step(); partitioned parameters take none.
#pragma once

#include <vector>

#include "engine/updater/landing_graph.h"
#include "hemiola/update_types.h"

namespace hemiola {

class PreviewLanding {
 public:
  // `graph` must outlive this.
  PreviewLanding(LandingGraph& graph, const UpdaterOptions& options)
      : graph_(graph), correct_on_arrival_(options.correct_on_arrival) {}

  // Previews land: the reducer takes them, and they land on arrival as
  // corrections do (both depend on timing).
  bool enabled() const;
  // A new pending iteration: with previews on, none of its previews has
  // landed or been seen.
  void start(Pending& pending) const;
  // Lands the previews of `pending` that have arrived.
  void land(Pending& pending);
  // Waits for the previews of `needed` that can still land.
  void wait(Pending& pending, const std::vector<size_t>& needed);

 private:
  bool awaits_preview(const Pending& pending, size_t i) const;
  bool previewed(Pending& pending, size_t index) const;

  LandingGraph& graph_;
  bool correct_on_arrival_;  // UpdaterOptions::correct_on_arrival
};

}  // namespace hemiola
