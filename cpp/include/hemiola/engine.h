// The engine: one object per process and group of ranks. It owns its
// communicator, its scheduler thread and its buffers; there is no
// process-global state, so several engines can live in one process (that is
// how the C++ tests run ranks as threads).
//
// Every collective goes through one scheduler thread and is issued in
// submission order, which is therefore the order on every rank as long as
// every rank submits the same operations in the same order.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hemiola/config.h"
#include "hemiola/export.h"
#include "hemiola/handle.h"
#include "hemiola/reducer.h"
#include "hemiola/store.h"
#include "hemiola/streamer.h"
#include "hemiola/tensor.h"

namespace hemiola {

enum class ReduceOp : int { kSum = 0, kAverage = 1 };

class EngineImpl;

// world_size + 1 element offsets: rank r's chunk of a tensor of `numel`
// elements of `dtype` under reduce_scatter and all_gather_chunks is
// [bounds[r], bounds[r + 1]). Contiguous, in rank order, covering the tensor;
// the last chunks may be short or empty (Gloo's ring geometry).
HEMIOLA_API std::vector<size_t> chunk_bounds(size_t numel, DType dtype, int world_size);

// world_size + 1 element offsets: rank r's chunk under reduce_scatter_coded,
// whole blocks of the block codings (kInt8Block elements): the blocks cut
// into world_size runs of ceil(blocks / world_size); the last may be short or empty.
HEMIOLA_API std::vector<size_t> coded_chunk_bounds(size_t numel, int world_size);

class HEMIOLA_API Engine {
 public:
  // Rendezvous with the other `world_size - 1` ranks through `store` and
  // connect to them. Blocks until all have arrived or `timeout_s` passes.
  Engine(const EngineOptions& options, std::shared_ptr<Store> store);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const;
  int world_size() const;
  const EngineOptions& options() const;
  // The main wire's transport, for logs: "gloo/tcp 10.0.0.1", with "(K stripes)"
  // when gloo_stripes > 1.
  std::string transport() const;

  // Asynchronous collectives: the tensor must stay alive until the handle is
  // done. All are in place except all_gather (output holds world_size inputs).
  Handle all_reduce(const TensorRef& tensor, ReduceOp op = ReduceOp::kSum);
  Handle broadcast(const TensorRef& tensor, int root = 0);
  Handle all_gather(const TensorRef& input, const TensorRef& output);
  Handle barrier();
  // The two halves of an all-reduce, in place over the ring's chunks
  // (chunk_bounds below): after reduce_scatter this rank's chunk holds the
  // sum (or average) over ranks, bitwise what all_reduce leaves there, and
  // the rest of the tensor partial sums; all_gather_chunks then gives every
  // rank each rank's chunk. CPU tensors (the Gloo wire). `bounds`
  // (world_size + 1 element offsets) gathers other chunks: those of a
  // reduce-scatter of the same elements in another dtype.
  Handle reduce_scatter(const TensorRef& tensor, ReduceOp op = ReduceOp::kAverage);
  Handle all_gather_chunks(const TensorRef& tensor, std::vector<size_t> bounds = {});
  // The same over the concatenation of `segments` (one dtype), each written
  // where it lies: a bucket's parameters gathered in place, with no buffer.
  Handle all_gather_chunks(std::vector<TensorRef> segments, std::vector<size_t> bounds = {});
  // A reduce-scatter (average) of a float32 CPU tensor coded as `coding`
  // (kInt8 or kInt4: a scale per block, error feedback): every rank adds
  // `residual` (float32, as many elements) to `tensor`, codes it with its own
  // scales, keeps what the coding dropped in `residual`, and sends chunk c's
  // records to rank c (coded_chunk_bounds); rank c decodes the ranks' records
  // of its chunk and averages them in float32, in rank order, into its chunk
  // of `tensor`. The codes are never summed on the wire, so the precision is
  // the same at any number of ranks. Outside the chunk `tensor` is left
  // holding what the coding dropped.
  Handle reduce_scatter_coded(const TensorRef& tensor, const TensorRef& residual,
                              Compression coding);

  // A gradient reducer over `specs` (one per gradient tensor, in registration
  // order). See reducer.h.
  std::unique_ptr<Reducer> make_reducer(const std::vector<GradSpec>& specs,
                                        const ReducerOptions& options);

  // The `streaming` schedule over `params` (see streamer.h), averaging
  // across this engine's ranks. Connects its wire: every rank makes it at
  // the same point. `group`: the engine of this rank's replica group (ranks
  // whose parameters a per-step schedule keeps equal), or null when each
  // rank is a replica alone. With a group of L ranks this engine's ranks
  // are the ranks of the same place in every group; each averages 1/L of
  // every fragment, and the group gathers the pieces on its own wire.
  std::unique_ptr<Streamer> make_streamer(std::vector<StreamedParameter> params,
                                          const StreamerOptions& options,
                                          Engine* group = nullptr);

  // Chrome trace-event JSON ("traceEvents") of what the engine recorded since
  // construction, when EngineOptions::timeline is on.
  std::string timeline_json() const;
  // Adds a caller's event (e.g. a forward pass) to the timeline, on `lane`.
  // Times are timeline_now_us() readings. A no-op when the timeline is off.
  void timeline_record(const std::string& lane, const std::string& name,
                       const std::string& category, int64_t start_us, int64_t end_us);
  int64_t timeline_now_us() const;

  EngineImpl& impl() { return *impl_; }

 private:
  std::unique_ptr<EngineImpl> impl_;
};

}  // namespace hemiola
