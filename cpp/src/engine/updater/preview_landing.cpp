// engine/updater/preview_landing.h.
#include "engine/updater/preview_landing.h"

#include <cstdint>
#include <utility>

namespace hemiola {

bool PreviewLanding::enabled() const {
  return graph_.reducer().options().preview && correct_on_arrival_;
}

void PreviewLanding::start(Pending& pending) const {
  if (!enabled()) return;
  pending.previewed.assign(graph_.size(), 0);
  pending.bucket_previewed.assign(graph_.bucket_count(), 0);
}

// The approximate step again, from the preview's estimate of the average
// instead of the rank's own gradient, for every parameter whose preview has
// arrived, whose exact step has not, and that no forward read since step().
// With clipping the preview is scaled by the local gradient's clipping
// coefficient (StepOptions::preview_scale): the averaged gradient's own
// needs all of it, and the exact step that follows uses that. (Not with a
// GradScaler or unused parameters, whose updates need the whole averaged
// gradient; not for partitioned tensors.)
void PreviewLanding::land(Pending& pending) {
  std::vector<size_t> chosen;
  for (size_t i : pending.remaining) {
    if (awaits_preview(pending, i) && previewed(pending, i)) chosen.push_back(i);
  }
  if (chosen.empty()) return;
  const int64_t start = graph_.now_us();
  StepGroup group;
  group.options = &pending.options;
  group.grad_scale = pending.options.preview_scale;
  for (size_t i : chosen) {
    group.indices.push_back(i);
    group.grads.push_back(graph_.previews()->value(pending.iteration, i).data);
    pending.previewed[i] = 1;
  }
  std::vector<StepGroup> chain{std::move(group)};
  graph_.local(chain);
  graph_.record("preview", start, "preview step (", chosen.size(), " parameters)");
}

// A forward never reads the rank's own-gradient step where a preview is
// coming. The wait is short: the preview lane carries only this iteration's
// previews, a quarter of the bytes.
void PreviewLanding::wait(Pending& pending, const std::vector<size_t>& needed) {
  const int64_t start = graph_.now_us();
  bool waited = false;
  for (size_t i : needed) {
    if (!awaits_preview(pending, i)) continue;
    for (size_t b : graph_.buckets_of(i)) {
      if (pending.bucket_previewed[b]) continue;
      graph_.previews()->wait(pending.iteration, b, nullptr);
      waited = true;
    }
  }
  if (waited) graph_.record("wait", start, "wait previews (", pending.iteration, ")");
}

// Parameter i's live value may still become its preview step: its exact
// step has not landed, no forward read it since step(), it took the local
// step and not yet the preview's, and it is whole (not partitioned).
bool PreviewLanding::awaits_preview(const Pending& pending, size_t i) const {
  return !pending.applied[i] && !graph_.was_read(i) && !pending.previewed[i] &&
         pending.stepped[i] && !graph_.partitioned(i);
}

bool PreviewLanding::previewed(Pending& pending, size_t index) const {
  for (size_t b : graph_.buckets_of(index)) {
    if (!pending.bucket_previewed[b]) {
      if (!graph_.previews()->done(pending.iteration, b)) return false;
      pending.bucket_previewed[b] = 1;
    }
  }
  return true;
}

}  // namespace hemiola
