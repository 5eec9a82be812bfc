// The `streaming` schedule: low-communication training (DiLoCo, and
// Streaming DiLoCo's staggered fragments) for links far slower than the
// computation.
//
// Each rank steps its own (inner) optimizer on its own data; the Streamer
// never touches gradients. Every `sync_every` (H) inner steps each fragment
// of the model is synchronised:
//   pseudo-gradient   d_r = shared - live_r        (the last synchronised copy
//                                                    minus this rank's progress)
//   average           d   = mean over ranks of d_r (through the wire's coding)
//   outer step        shared' = outer SGD step of `shared` with gradient d
//                     (default lr 1, no momentum: the average; DiLoCo's is
//                     lr 0.7, Nesterov momentum 0.9: diloco_outer())
//   merge             live_r  = shared' + (live_r(now) - live_r(sent))   (eager)
//                  or live_r  = shared' + a * (live_r(now) - shared')  (mix, a = mix)
// The fragments are the buckets of a plan over the parameters capped at
// 1/fragments of the model; fragment p syncs after inner steps s with
// s % H == ((p + 1) * H / fragments) % H, so they are spread evenly over the
// H steps and at most one is on the wire at a time. Its average is reduced on
// a wire of its own under the next `overlap` (tau) inner steps and lands after
// inner step s + tau; until then the rank's own progress stands in for it,
// and it is kept on top of the new shared copy when it lands (the merge
// above). With tau = 0 the merge is live_r = shared': every rank holds the
// same parameters after each sync (blocking). The shared copy, the outer
// momentum and the wire's averages are bitwise the same on every rank.
//
// Memory, per parameter element, host memory in the parameters' dtype: the
// shared copy, the outer momentum and the pseudo-gradient buffers (3x the
// model), plus the live values the fragment in flight was sent from (the
// largest fragment), plus, with int8 or int4, one float32 residual per element.
//
// The live values are host memory: for a GPU model the caller keeps a host
// copy of the parameters and moves the fragments of next_step_fragments()
// across around each after_inner_step() (python/hemiola/streaming.py does).
// Not thread-safe: one training loop calls it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hemiola/config.h"
#include "hemiola/export.h"
#include "hemiola/optimizer.h"
#include "hemiola/tensor.h"

namespace hemiola {

struct StreamerOptions {
  size_t sync_every = 100;  // H: inner steps between two syncs of a fragment
  size_t fragments = 1;     // how many pieces the model is synchronised in
  // tau: inner steps a fragment's average may take to arrive before it is
  // waited for. Less than sync_every / fragments (one fragment on the wire
  // at a time).
  size_t overlap = 0;
  // The outer optimizer: SGD (lr, momentum, dampening, nesterov,
  // weight_decay of OptimizerHyper); default_outer() or diloco_outer().
  OptimizerHyper outer = default_outer();
  // How the pseudo-gradients travel (float32 parameters; others as they are):
  // kNone, kFp16, kBf16, kInt8 or kInt4 (with error feedback).
  Compression compression = Compression::kNone;
  // The merge when a fragment lands. Negative: eager (the progress made since
  // the send stays on top of the new shared copy). In [0, 1]: Streaming
  // DiLoCo's mix, live = mix * live + (1 - mix) * shared', computed as
  // torch's shared'.lerp_(live, mix) (torchft's fragment_update_alpha; 0
  // replaces the live values by the shared copy).
  double mix = -1.0;
  // Check every fragment's average for NaN and infinity when it lands, and
  // throw (ErrorCode::kNotFinite, naming a parameter it holds) instead of
  // applying it: the average is the same on every rank, so every rank throws.
  bool check_finite = false;
  // Elastic membership (python/hemiola/elastic): every average ends with a
  // confirmation, an all-gather of one word per rank, so that a failure
  // leaves each survivor knowing whether the average may be kept
  // (fragment_averager.h). In a replica group the group's gather carries
  // every rank's verdict, so its ranks raise, keep or redo alike.
  bool confirm = false;

  // The outer step by default: the average itself (lr 1, no momentum: the
  // models averaged, local SGD), which measured best at tens of syncs
  // (docs/streaming.md, "Choosing the options").
  static OptimizerHyper default_outer() {
    OptimizerHyper hyper;
    hyper.lr = 1.0;
    return hyper;
  }
  // DiLoCo's outer step (lr 0.7, Nesterov momentum 0.9), made for hundreds
  // of inner steps per sync and hundreds of syncs.
  static OptimizerHyper diloco_outer() {
    OptimizerHyper hyper;
    hyper.lr = 0.7;
    hyper.momentum = 0.9;
    hyper.nesterov = true;
    return hyper;
  }
};

struct StreamedParameter {
  std::string name;  // for error messages
  TensorRef param;   // the live values the inner optimizer steps
};

class Engine;
class StreamerImpl;

class HEMIOLA_API Streamer {
 public:
  explicit Streamer(std::unique_ptr<StreamerImpl> impl);
  ~Streamer();

  // After each inner optimizer step: counts it (s = 1, 2, ...), lands the
  // fragment whose overlap ends now (waiting for its average if it has not
  // arrived), and sends the fragments due after step s.
  void after_inner_step();
  // The fragments the next after_inner_step() will read or write the live
  // values of (the one that lands, those sent), without changing anything:
  // a caller that keeps the live values elsewhere (a GPU model's host copy)
  // refreshes exactly these before the step and writes them back after.
  std::vector<size_t> next_step_fragments() const;
  // Inner steps counted so far.
  uint64_t inner_steps() const;

  // ---- elastic membership (options().confirm) ---------------------------
  // When after_inner_step() threw because a replica failed (the wire's
  // error), the step is counted and the fragment in flight kept; the caller
  // agrees on the survivors, then rejoin()s them and finish_step()s.
  //
  // Moves the averages to `across` (the survivors' or the grown membership's
  // engine; a rendezvous). With a fragment in flight whose average failed:
  // `redo` averages it again over `across` from the live values it was sent
  // from (no inner step is lost); otherwise its average is kept (every rank
  // completed it: averaged_before_failure() on all). The coding's residuals
  // start again from zero (the pieces' owners change with the membership).
  void rejoin(Engine& across, bool redo);
  // The rest of the inner step whose after_inner_step() threw: lands the
  // fragment due and sends those due after it (no-op if it had finished).
  void finish_step();
  // A group joining a running run, after its shared copy and outer
  // momentum were written (shared(), outer_momentum()) from a member's:
  // takes the run's step count, sync count and momentum flags, and its live
  // values become the shared copy. Nothing may be in flight.
  void adopt(uint64_t inner_steps, uint64_t syncs, const std::vector<uint8_t>& momentum_started);
  // This rank has the in-flight fragment's average (its confirmation may
  // have failed; the coordinator keeps it only if every survivor has it).
  bool in_flight_averaged() const;
  // The sync the fragment in flight belongs to (0, 1, ...: syncs() at its send).
  uint64_t in_flight_round() const;
  // What this rank offers in its next confirmations (a membership epoch the
  // coordinator announced; any thread), and the largest offer confirmed
  // with the last landed average (the same on every rank).
  void offer(uint64_t epoch);
  uint64_t agreed_offer() const;
  // Waits until the fragment on the wire (if any) has its average; it still
  // lands after its step (a checkpoint then holds it: pending_*).
  void wait_in_flight();
  // How long after_inner_step() waited for averages so far (ms), and how
  // many fragments were synchronised.
  double waited_ms() const;
  // How long after_inner_step() worked on the calling thread so far (ms),
  // the waits excluded: packing, coding's share on this thread, the outer
  // step and the merge.
  double host_ms() const;
  uint64_t syncs() const;

  // ---- state (for checkpoints), per fragment in its plan layout (the
  // parameters' pieces as fragments() lists them, each parameter's elements
  // in order; large parameters may be cut across fragments)
  // The shared copy as of the last sync (the parameters' dtype).
  TensorRef shared(size_t fragment);
  // The outer optimizer's momentum buffer (zeros before its first sync).
  TensorRef outer_momentum(size_t fragment);
  // Compression::kInt8 / kInt4, per parameter: what this rank's coding dropped and
  // will add to its next pseudo-gradient (float32, one per element).
  TensorRef residual(size_t index);
  // The fragment in flight (-1: none) and the inner step it was sent after;
  // its average (waits for it) and the live values it was sent from, in its
  // layout (empty when none is in flight).
  int64_t in_flight_fragment() const;
  uint64_t in_flight_step() const;
  TensorRef in_flight_average();
  TensorRef in_flight_base();
  // Restores a checkpoint: the step count, the outer momentum's first-step
  // flag per fragment, and which fragment is in flight. Call on every rank,
  // with every shared/outer_momentum/residual written back first; then
  // write the fragment in flight's average and base through
  // in_flight_average()/in_flight_base() (which no longer wait).
  void restore(uint64_t inner_steps, const std::vector<uint8_t>& momentum_started,
               int64_t in_flight_fragment, uint64_t in_flight_step);
  std::vector<uint8_t> momentum_started() const;

  // The plan: fragment f holds (pieces of) parameters fragments()[f], in
  // order; the buffers above hold them back to back.
  std::vector<std::vector<size_t>> fragments() const;
  const StreamerOptions& options() const;

 private:
  std::unique_ptr<StreamerImpl> impl_;
};

}  // namespace hemiola
