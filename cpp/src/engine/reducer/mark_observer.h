// Who else learns of a gradient's mark: the one way in for the schedules that
// land reduced gradients themselves (engine/updater/). The iteration ring
// calls every observer on the marking thread, after the gradient is taken for
// its iteration and before it is copied into its buckets; the mark never
// passes through an observer on its way, it only tells them.
//
// Invariant: observers are added and removed only while nothing is being
// marked (the ring reads its list without a lock).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hemiola {

// One gradient's mark, as the ring sees it.
struct Mark {
  size_t index = 0;           // the gradient
  uint64_t iteration = 0;     // the iteration it is marked in
  const void* source = nullptr;  // what this rank contributes (copied into the buckets)
  const void* local = nullptr;   // this rank's own gradient (decoupled's local step)
  void* out = nullptr;        // where the reduced value goes (null: the reducer's buffers)
  void* stream = nullptr;     // CUDA: the stream that produced the gradient
};

class MarkObserver {
 public:
  virtual ~MarkObserver() = default;
  // On the marking thread (autograd's: several at once, for different
  // gradients). May set `mark.out`. Throwing refuses the mark: the ring is
  // aborted with the message (the iteration can no longer complete).
  virtual void on_mark(Mark& mark) = 0;
};

}  // namespace hemiola
