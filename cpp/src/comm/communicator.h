// Communicator: the collectives the engine needs, over some transport.
// Implementations: GlooCommunicator (CPU, TCP). Calls are blocking and are
// made from a single engine thread at a time, in the same order on every rank.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hemiola/tensor.h"

namespace hemiola {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  // In-place sum over all ranks. Floating dtypes (and integer ones, exactly).
  virtual void all_reduce_sum(const TensorRef& tensor) = 0;
  // In place: every rank receives root's bytes.
  virtual void broadcast(const TensorRef& tensor, int root) = 0;
  // output = concat over ranks of input (output.numel == size() * input.numel).
  virtual void all_gather(const TensorRef& input, const TensorRef& output) = 0;
  // input and output hold size() chunks of equal length: chunk r of input
  // goes to rank r, chunk r of output came from rank r (a reduce-scatter's
  // traffic, (size - 1) / size of the input leaving each rank).
  virtual void all_to_all(const TensorRef& input, const TensorRef& output) = 0;
  // In place, over the ring's chunks (comm/ring_chunks.h): afterwards chunk
  // rank() holds the sum over ranks, bitwise what all_reduce_sum leaves
  // there (the same chunks, summed in the same order); the other chunks hold
  // partial sums. (size - 1) / size of the tensor leaves each rank.
  virtual void reduce_scatter_sum(const TensorRef& tensor) = 0;
  // In place: every rank's chunk r becomes rank r's chunk r; reduce_scatter_sum's
  // other half. The tensor is the concatenation of `segments` (one dtype;
  // separate memory, e.g. the parameters of a bucket, each written where it
  // lies). Chunk r is elements [bounds[r], bounds[r + 1]) of it (size() + 1
  // offsets, contiguous, covering it), or the ring's chunks when `bounds` is
  // empty (a reduce-scatter on another dtype, e.g. a half-precision wire,
  // cuts its chunks elsewhere: the caller passes them).
  virtual void all_gather_chunks(const std::vector<TensorRef>& segments,
                                 const std::vector<size_t>& bounds) = 0;
  void all_gather_chunks(const TensorRef& tensor, const std::vector<size_t>& bounds = {}) {
    all_gather_chunks(std::vector<TensorRef>{tensor}, bounds);
  }
  virtual void barrier() = 0;
  // After a failure: closes this rank's connections, so that peers blocked
  // on it fail now rather than at their timeout (and reach the failure's
  // diagnosis while this rank still waits there). Later calls throw.
  virtual void abort() {}
};

}  // namespace hemiola
