// Communicator over Gloo's TCP transport (CPU tensors).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "hemiola/config.h"
#include "hemiola/store.h"

namespace gloo {
class Context;
}

namespace hemiola {

class GlooCommunicator final : public Communicator {
 public:
  // Rendezvous through `store` and connect a full mesh of TCP pairs. The
  // interface is chosen from options (iface, hostname, master_addr).
  GlooCommunicator(const EngineOptions& options, Store& store);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "gloo/tcp " + address_; }
  void all_reduce_sum(const TensorRef& tensor) override;
  void broadcast(const TensorRef& tensor, int root) override;
  void all_gather(const TensorRef& input, const TensorRef& output) override;
  void barrier() override;
  void abort() override;

 private:
  int rank_;
  int size_;
  std::string address_;  // what we bound, for messages
  std::chrono::milliseconds timeout_;
  // Null once aborted: every later collective throws.
  std::shared_ptr<gloo::Context> context_;
  // The context, or a kCommFailure naming `what` after abort().
  const std::shared_ptr<gloo::Context>& context(const char* what) const;
};

}  // namespace hemiola
