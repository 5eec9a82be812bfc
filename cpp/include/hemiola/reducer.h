// Gradient reducer: fuses gradients into buckets and all-reduces each bucket
// as soon as all its gradients are ready, while backward is still running.
//
// Life of one iteration:
//   mark_ready(i, grad) for each gradient as autograd produces it (any thread,
//   lock-free: copies the gradient into its bucket and decrements the bucket's
//   atomic pending count; the last one enqueues the bucket), optionally
//   mark_unused(i) for gradients that will not come, then wait(). The engine's
//   scheduler issues buckets strictly in plan order 0, 1, 2, ... on every rank,
//   whatever order they become ready in, and writes the (averaged) result back
//   to the tensors given to mark_ready.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "hemiola/export.h"
#include "hemiola/handle.h"
#include "hemiola/tensor.h"

namespace hemiola {

struct GradSpec {
  DType dtype = DType::kFloat32;
  size_t numel = 0;
  std::string name;  // for error messages, e.g. "layer1.0.conv1.weight"
};

class ReducerImpl;

class HEMIOLA_API Reducer {
 public:
  explicit Reducer(std::unique_ptr<ReducerImpl> impl);
  ~Reducer();

  // Hook path. `grad` must match spec `index` in dtype and element count and
  // stay alive until wait() returns. Throws if `index` was already marked in
  // this iteration.
  void mark_ready(size_t index, const TensorRef& grad);
  // Same, taking only the data pointer (dtype and count from the spec).
  void mark_ready(size_t index, void* data);
  // Contributes zeros for `index` this iteration; its result is not written
  // back anywhere (read it with copy_out).
  void mark_unused(size_t index);
  // Indices not yet marked in the current iteration (in index order).
  std::vector<size_t> unmarked() const;
  // True when an iteration has started (something was marked) and not yet
  // been waited for.
  bool in_iteration() const;

  // Blocks until every bucket of the current iteration is reduced and written
  // back. Throws on failure or after the engine's timeout, naming the pending
  // buckets and their tensors.
  void wait();
  // Cancels the current iteration: the scheduler stops waiting for buckets
  // that will not become ready. The reducer is unusable afterwards.
  void abort(const std::string& reason);

  // After wait(): copies the reduced value of `index` into dst.
  void copy_out(size_t index, const TensorRef& dst) const;
  // After wait() with track_usage: how many ranks produced a gradient for each
  // tensor in the last iteration.
  std::vector<int> usage() const;

  // The current plan: bucket b holds tensors buckets()[b], in pack order.
  std::vector<std::vector<size_t>> buckets() const;
  // Order in which tensors became ready in the first recorded iteration.
  std::vector<size_t> observed_order() const;
  // Collective: every rank adopts rank 0's observed order and rebuilds its
  // plan from it. Call between iterations, on every rank.
  void rebuild_from_observed_order();
  // Local: rebuild the plan so tensors are bucketed in `order`.
  void rebuild(const std::vector<size_t>& order);

  // Iterations completed.
  uint64_t iteration() const;

 private:
  std::unique_ptr<ReducerImpl> impl_;
};

}  // namespace hemiola
