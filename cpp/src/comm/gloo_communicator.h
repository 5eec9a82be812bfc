// Communicator over Gloo's TCP transport (CPU tensors).
//
// With EngineOptions::gloo_stripes = K > 1 it holds K connections (a TCP
// device, a context and, past the first, a thread each): an all-reduce of at
// least K * kMinStripeBytes is cut into K contiguous parts reduced at once,
// one per connection, the first on the calling thread. Every other
// collective, and smaller all-reduces, use the first connection. The cut
// depends only on the element count and K, so it is the same on every rank.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "hemiola/config.h"
#include "hemiola/store.h"

namespace gloo {
class Context;
}

namespace hemiola {

class StripeThread;

class GlooCommunicator final : public Communicator {
 public:
  // An all-reduce is striped only when each part has at least this many bytes.
  static constexpr size_t kMinStripeBytes = size_t{64} << 10;

  // Rendezvous through `store` and connect a full mesh of TCP pairs. The
  // interface is chosen from options (iface, hostname, master_addr).
  GlooCommunicator(const EngineOptions& options, Store& store);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override;
  void all_reduce_sum(const TensorRef& tensor) override;
  void broadcast(const TensorRef& tensor, int root) override;
  void all_gather(const TensorRef& input, const TensorRef& output) override;
  void all_to_all(const TensorRef& input, const TensorRef& output) override;
  void reduce_scatter_sum(const TensorRef& tensor) override;
  using Communicator::all_gather_chunks;
  void all_gather_chunks(const std::vector<TensorRef>& segments,
                         const std::vector<size_t>& bounds) override;
  void barrier() override;
  void abort() override;

 private:
  int rank_;
  int size_;
  std::string address_;  // what we bound, for messages
  std::chrono::milliseconds timeout_;
  // Null once aborted: every later collective throws.
  std::shared_ptr<gloo::Context> context_;
  // Stripes 1..K-1 (empty unless gloo_stripes > 1): their contexts, and a
  // thread each that runs its part of a striped all-reduce (declared after
  // the contexts, so joined before the contexts they use go).
  std::vector<std::shared_ptr<gloo::Context>> stripe_contexts_;
  std::vector<std::unique_ptr<StripeThread>> stripe_threads_;
  // The context, or a kCommFailure naming `what` after abort().
  const std::shared_ptr<gloo::Context>& context(const char* what) const;
  // Refuses, on every rank, a gloo_stripes that differs across ranks.
  void check_stripes_agree(int stripes);
  // Sums `numel` elements of `dtype` at `data` in place over `context`.
  void all_reduce_part(const std::shared_ptr<gloo::Context>& context, DType dtype, void* data,
                       size_t numel);
};

}  // namespace hemiola
