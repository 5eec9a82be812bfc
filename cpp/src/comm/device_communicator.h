// DeviceCommunicator: collectives on CUDA device memory, enqueued on a stream.
//
// Implementations: NcclCommunicator (NCCL, one rank per GPU) and
// StagedGlooCommunicator (through pinned host memory and Gloo, for machines
// without NCCL and for several ranks sharing one GPU). Calls come from the
// engine's scheduler thread only, in the same order on every rank.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "hemiola/tensor.h"

namespace hemiola {

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual std::string name() const = 0;
  // Enqueues on `stream` the in-place sum (or, with `average`, mean) over all
  // ranks of the floating device tensor `tensor`. Returns once enqueued (the
  // Gloo fallback returns once done); the result is ordered on `stream`.
  virtual void all_reduce(const TensorRef& tensor, bool average, void* stream) = 0;
  // Throws Error(kCommFailure) if the transport failed asynchronously since
  // the last call (a peer died, NCCL reported an error).
  virtual void check() {}
  // Tears the transport down without waiting for peers, so work stuck on the
  // device completes with an error instead of never.
  virtual void abort() {}
};

// Gloo over `host` with device tensors staged through pinned host memory on
// copy streams of its own; the caller's stream waits for the result on the
// device. `chunk_bytes` 0: each reduction staged whole; > 0: pipelined in
// chunks of that size (EngineOptions::staged_chunk_bytes). `host` must
// outlive the communicator.
std::unique_ptr<DeviceCommunicator> make_staged_gloo_communicator(Communicator& host, int device,
                                                                  size_t chunk_bytes);

}  // namespace hemiola
