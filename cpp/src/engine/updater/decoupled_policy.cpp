// The decoupled schedule (hemiola/updater.h, kDecoupled). step() lands the
// previous iteration's exact step (waiting if needed) and takes the
// approximate step: the exact parameters (the shadow, kept here) stepped with
// this rank's own gradient, written to the live parameters only. The exact
// step lands, from the shadow with the averaged gradient, as soon as it has
// arrived and no forward still reads the approximate value
// (correct_on_arrival), at the latest in the next step(). With a preview,
// engine/updater/preview_landing.h.
//
// The reducer's in_flight bounds the pending iterations: step() of iteration
// t lands t - in_flight (waiting) before taking t's approximate step; each
// parameter lands its iterations in order. Invariant per parameter: live =
// shadow stepped with the local gradient of every pending iteration that has
// not landed it, in order (with a preview, in_flight 1: its estimate
// instead). After an older iteration lands, the later local steps are taken
// again (re-steps), from copies of their gradients and through scratch
// optimizer state.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/updater/landing_graph.h"
#include "engine/updater/preview_landing.h"
#include "engine/updater/update_policy.h"

namespace hemiola {

namespace {

class DecoupledPolicy final : public UpdatePolicy {
 public:
  DecoupledPolicy(LandingGraph& graph, const UpdaterOptions& options)
      : graph_(graph), correct_on_arrival_(options.correct_on_arrival),
        previews_(graph, options) {
    // The first iteration lands after the rebuild (see step()).
    graph_.gather_until_rebuilt();
  }

  void adopt() override {
    const size_t n = graph_.size();
    shadow_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const auto& p = graph_.params()[i].param;
      graph_.copy(shadow_[i].reserve(graph_.device(), p.nbytes()), p.data, p.nbytes());
      graph_.set_exact(i, shadow_[i].data());
    }
  }

  // Every gradient is taken; its local step reads this rank's own gradient.
  void on_mark(Mark& mark) override {
    graph_.set_local_grad(mark.index, mark.local);
  }

  void step(uint64_t iteration, const StepOptions& options) override {
    std::vector<int> usage;
    bool gathered = false;
    if (!graph_.rebuilt()) {
      // The first iteration takes the same steps as every other (the local
      // one now, the exact one later), so that a run resumed from a
      // checkpoint repeats the run that saved it; only its timing differs:
      // the reduction is waited for so that the buckets can be rebuilt, and
      // its results were written to the updater's own buffers.
      graph_.reduction().wait_iteration(iteration, graph_.stream().handle);
      if (options.has_unused) usage = graph_.reduction().usage(iteration);
      graph_.rebuild_buckets();
      gathered = true;
    }
    // With this one, at most in_flight iterations stay pending: the oldest
    // land now (waiting); the others land what has arrived.
    auto& pending_list = graph_.pending();
    while (pending_list.size() >= graph_.in_flight()) land_oldest();
    if (correct_on_arrival_ && !pending_list.empty()) land_arrived();
    Pending& pending = graph_.start_pending(iteration, options);
    pending.gathered = gathered;
    pending.usage = std::move(usage);
    const size_t n = graph_.size();
    pending.stepped.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      pending.stepped[i] = !options.local_overflow && graph_.local_grad(i) != nullptr;
    }
    if (graph_.in_flight() > 1) {
      // The gradients' memory is the caller's until the next backward; a
      // local step is re-taken after an older iteration lands.
      pending.local.resize(n);
      for (size_t i = 0; i < n; ++i) {
        if (!pending.stepped[i]) continue;
        const size_t bytes = graph_.params()[i].param.nbytes();
        graph_.copy(pending.local[i].reserve(graph_.device(), bytes), graph_.local_grad(i),
                    bytes);
      }
    }
    if (!options.local_overflow) {
      // The approximate step: the exact values stepped with this rank's own
      // gradient (after the local steps of older pending iterations), into
      // the live parameters only.
      const int64_t start = graph_.now_us();
      std::vector<size_t> stepped;
      for (size_t i = 0; i < n; ++i) {
        if (pending.stepped[i]) stepped.push_back(i);
      }
      restep(stepped);
      graph_.record("step", start, "local step ", iteration);
    }
    previews_.start(pending);
  }

  void land(const std::vector<size_t>& needed, bool training) override {
    auto& pending_list = graph_.pending();
    if (!pending_list.empty() && correct_on_arrival_) {
      Pending& newest = pending_list.back();  // with a preview the only one (in_flight 1)
      if (!newest.previewed.empty() && newest.preview_allowed()) previews_.wait(newest, needed);
      land_arrived();
    }
    if (!training) return;
    for (size_t i : needed) {
      const uint64_t numel = graph_.params()[i].param.numel;
      reads_ += numel;
      if (!pending_list.empty() && !pending_list.back().applied[i]) {  // parameters land in order
        approximate_reads_ += numel;
        const Pending& newest = pending_list.back();
        if (!newest.previewed.empty() && newest.previewed[i]) previewed_reads_ += numel;
      }
    }
  }

  void land_all() override {
    while (!graph_.pending().empty()) land_oldest();
  }

  double approximate_read_fraction() const override {
    return reads_ == 0 ? 0.0 : static_cast<double>(approximate_reads_) / reads_;
  }

  double preview_read_fraction() const override {
    return reads_ == 0 ? 0.0 : static_cast<double>(previewed_reads_) / reads_;
  }

 private:
  // Lands the oldest pending iteration's exact step of every parameter
  // (waiting for it).
  void land_oldest() {
    Pending& pending = graph_.pending().front();
    const std::vector<size_t> chosen = pending.remaining;
    if (!chosen.empty()) {
      graph_.wait_for(pending, chosen);
      correct(pending, chosen);
    }
    graph_.pending().pop_front();
  }

  // Lands the exact steps that have arrived, of parameters no forward read
  // since step() and whose older iterations have landed; with a preview,
  // lands the previews that have arrived instead.
  //
  // With the preview on, exact steps land only when waited for (in step()),
  // never on arrival: a forward then reads the preview's estimate for every
  // layer, not exact back layers beside approximate front ones. That mix
  // measured worse on the LM with AdamW (+1.85% held-out loss from wfbp
  // against +0.95% with every read on the estimate, 12 seeds; see
  // docs/schedules.md), and the model reproduces it.
  void land_arrived() {
    auto& pending_list = graph_.pending();
    for (size_t k = 0; k < pending_list.size(); ++k) {
      Pending& pending = pending_list[k];
      if (!pending.previewed.empty()) {
        if (pending.preview_allowed()) previews_.land(pending);
        continue;
      }
      if (pending.needs_whole()) continue;
      std::vector<size_t> chosen;
      for (size_t i : pending.remaining) {
        if (!graph_.was_read(i) && landed_before(k, i) && graph_.arrived(pending, i)) {
          chosen.push_back(i);
        }
      }
      if (!chosen.empty()) correct(pending, chosen);
    }
    while (!pending_list.empty() && pending_list.front().remaining.empty()) {
      pending_list.pop_front();
    }
  }

  // The iterations pending before pending()[k] have landed parameter i.
  bool landed_before(size_t k, size_t i) const {
    const auto& pending_list = graph_.pending();
    for (size_t j = 0; j < k; ++j) {
      if (!pending_list[j].applied[i]) return false;
    }
    return true;
  }

  // The exact step of `chosen` lands; where a later iteration is pending
  // (in_flight > 1), its local steps are taken again on top.
  void correct(Pending& pending, const std::vector<size_t>& chosen) {
    const int64_t start = graph_.now_us();
    graph_.apply(pending, chosen);
    if (&pending != &graph_.pending().back()) {
      std::vector<size_t> again;
      for (size_t i : chosen) {
        if (steps_pending(i)) again.push_back(i);
      }
      restep(again);
    }
    graph_.record("correction", start, "exact step (", chosen.size(), " parameters)");
  }

  // An iteration whose local step of parameter i is in the live value has
  // not landed it.
  bool steps_pending(size_t i) const {
    for (const Pending& p : graph_.pending()) {
      if (!p.applied[i] && !p.stepped.empty() && p.stepped[i]) return true;
    }
    return false;
  }

  // Live parameters `indices` <- the shadow stepped with the local gradient
  // of every pending iteration that has not landed them (the invariant), in
  // order, nothing committed. Parameters with the same pending steps go to
  // the stepper as one chain (an external stepper's call per link).
  void restep(const std::vector<size_t>& indices) {
    const auto& pending_list = graph_.pending();
    // (the positions in pending_list of the steps, the parameters taking them)
    std::vector<std::pair<std::vector<size_t>, std::vector<size_t>>> chains;
    std::vector<size_t> steps;
    for (size_t i : indices) {
      steps.clear();
      for (size_t k = 0; k < pending_list.size(); ++k) {
        const Pending& p = pending_list[k];
        if (!p.applied[i] && p.stepped[i]) steps.push_back(k);
      }
      if (steps.empty()) {
        graph_.restore(i);
        continue;
      }
      auto same = std::find_if(chains.begin(), chains.end(),
                               [&](const auto& chain) { return chain.first == steps; });
      if (same == chains.end()) same = chains.insert(chains.end(), {steps, {}});
      same->second.push_back(i);
    }
    for (const auto& [links, members] : chains) {
      std::vector<StepGroup> chain(links.size());
      for (size_t l = 0; l < links.size(); ++l) {
        const Pending& p = pending_list[links[l]];
        chain[l].indices = members;
        chain[l].options = &p.options;
        for (size_t i : members) chain[l].grads.push_back(local_grad(p, i));
      }
      graph_.local(chain);
    }
  }

  // The local gradient `pending` stepped parameter i with: the caller's
  // during its step(), a copy of it afterwards (in_flight > 1).
  const void* local_grad(const Pending& pending, size_t i) const {
    return pending.local.empty() ? graph_.local_grad(i) : pending.local[i].data();
  }

  LandingGraph& graph_;
  bool correct_on_arrival_;  // UpdaterOptions::correct_on_arrival
  PreviewLanding previews_;
  std::vector<Buffer> shadow_;  // the exact parameters (the graph's exact values)
  uint64_t reads_ = 0;
  uint64_t approximate_reads_ = 0;
  uint64_t previewed_reads_ = 0;  // approximate reads of a preview step
};

}  // namespace

std::unique_ptr<UpdatePolicy> make_decoupled_policy(LandingGraph& graph,
                                                    const UpdaterOptions& options) {
  return std::make_unique<DecoupledPolicy>(graph, options);
}

}  // namespace hemiola
