// The priority schedule (hemiola/updater.h, kPriority): exact synchronous
// SGD. step() applies the update of every parameter whose reduction has
// arrived; land(l) waits for gate l's buckets and applies theirs.
//
// Invariants: at most one iteration is pending (the reducer's in_flight is
// 1); a parameter is written only if no forward read it since step()
// (autograd may still need the value) or when a gate needs it; a gradient
// is marked only for a parameter whose previous update has landed.
#include <memory>
#include <string>
#include <vector>

#include "engine/updater/landing_graph.h"
#include "engine/updater/update_policy.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

class PriorityPolicy final : public UpdatePolicy {
 public:
  PriorityPolicy(LandingGraph& graph, const UpdaterOptions& options)
      : graph_(graph), front_fraction_(options.priority_front_fraction) {}

  void adopt() override { selected_.assign(graph_.size(), 0); }

  // A mark of a parameter whose previous update has not landed: the forward
  // read it before it was updated, so its gradient would be wrong.
  void on_mark(Mark& mark) override {
    const size_t index = mark.index;
    const auto& pending = graph_.pending();
    if (pending.empty() || pending.front().applied[index]) return;
    const std::string message = detail::concat(
        "schedule='priority': parameter '", graph_.params()[index].name,
        "' was read in this forward before its update from the previous iteration was "
        "applied, so its gradient would be wrong. Its update is applied where the first "
        "training forward read it first; this forward read it earlier. Use "
        "schedule='wfbp' for models whose order of parameter reads changes between "
        "iterations.");
    graph_.reducer().abort(message);
    HEMIOLA_THROW(ErrorCode::kAborted, message);
  }

  void step(uint64_t iteration, const StepOptions& options) override {
    land_all();  // whatever the previous iteration left (rare)
    graph_.start_pending(iteration, options);
    if (!graph_.rebuilt()) {
      // The first iteration runs synchronously; then the buckets are rebuilt
      // in the observed order and the issue order is derived from them.
      land_all();
      graph_.rebuild_buckets();
      graph_.reducer().set_issue_order(priority_order());
      return;
    }
    if (!graph_.pending().back().needs_whole()) update(graph_.all(), /*wait=*/false);
  }

  void land(const std::vector<size_t>& needed, bool training) override {
    if (!graph_.pending().empty()) update(needed, /*wait=*/true);
  }

  void land_all() override {
    if (!graph_.pending().empty()) update(graph_.all(), /*wait=*/true);
  }

  // Every read is of exact parameters.
  double approximate_read_fraction() const override { return 0.0; }
  double preview_read_fraction() const override { return 0.0; }

 private:
  // Plan order (backward order), except that the buckets holding the front
  // layers' first priority_front_fraction of the bytes go last, front-most
  // first: the same permutation on every rank, no negotiation.
  std::vector<size_t> priority_order() const {
    const std::vector<double>& bucket_bytes = graph_.bucket_bytes();
    const size_t n = bucket_bytes.size();
    double total = 0.0;
    for (double b : bucket_bytes) total += b;
    const double budget = front_fraction_ * total;
    std::vector<size_t> tail;  // the last buckets hold the front layers
    double covered = 0.0;
    for (size_t b = n; b-- > 0;) {
      if (covered >= budget || tail.size() + 1 >= n) break;
      tail.push_back(b);
      covered += bucket_bytes[b];
    }
    std::vector<size_t> order;
    for (size_t b = 0; b < n - tail.size(); ++b) order.push_back(b);
    order.insert(order.end(), tail.begin(), tail.end());
    return order;
  }

  // Applies the update of `wanted` (waiting for their buckets if `wait`, else
  // only those already reduced) and of every other parameter not read since
  // step() whose buckets are reduced: one pass of optimizer steps. The work
  // is over the parameters still pending, not all of them.
  void update(const std::vector<size_t>& wanted, bool wait) {
    Pending& pending = graph_.pending().front();  // the only one
    std::vector<size_t> todo;
    for (size_t i : wanted) {
      if (!pending.applied[i]) todo.push_back(i);
    }
    if (wait && !todo.empty()) graph_.wait_for(pending, todo);
    if (wait) {
      for (size_t i : todo) selected_[i] = 1;
    }
    std::vector<size_t> chosen;
    for (size_t i : pending.remaining) {
      if (selected_[i] || (!graph_.was_read(i) && graph_.arrived(pending, i))) {
        chosen.push_back(i);
      }
    }
    for (size_t i : todo) selected_[i] = 0;
    if (!chosen.empty()) {
      const int64_t start = graph_.now_us();
      graph_.apply(pending, chosen);
      graph_.record("step", start, "update ", chosen.size(), " parameters (", pending.iteration,
                    ")");
    }
    if (pending.remaining.empty()) graph_.pending().pop_front();
  }

  LandingGraph& graph_;
  double front_fraction_;  // UpdaterOptions::priority_front_fraction
  std::vector<uint8_t> selected_;  // scratch of update() (all zero between calls)
};

}  // namespace

std::unique_ptr<UpdatePolicy> make_priority_policy(LandingGraph& graph,
                                                   const UpdaterOptions& options) {
  return std::make_unique<PriorityPolicy>(graph, options);
}

}  // namespace hemiola
