#include "hemiola/engine.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include "comm/gloo_communicator.h"
#include "comm/ring_chunks.h"
#include "engine/codec/block_coding.h"
#include "engine/engine_impl.h"
#include "engine/reducer/reducer_impl.h"
#include "engine/streaming/streamer_impl.h"
#include "core/dtype_math.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

// A single collective on caller-owned memory.
class CollectiveWork final : public Work {
 public:
  enum class Kind {
    kAllReduce, kBroadcast, kAllGather, kBarrier, kReduceScatter, kAllGatherChunks,
    kReduceScatterCoded
  };
  CollectiveWork(Kind kind, TensorRef a, TensorRef b, ReduceOp op, int root, int world,
                 std::vector<size_t> bounds = {}, std::vector<TensorRef> segments = {},
                 Compression coding = Compression::kNone)
      : kind_(kind), a_(a), b_(b), op_(op), root_(root), world_(world),
        bounds_(std::move(bounds)), segments_(std::move(segments)), coding_(coding) {}

  void run(Communicator& comm, Timeline& timeline) override {
    const int64_t start = timeline.now_us();
    switch (kind_) {
      case Kind::kAllReduce:
        comm.all_reduce_sum(a_);
        if (op_ == ReduceOp::kAverage) scale_in_place(a_.dtype, a_.data, a_.numel, 1.0 / world_);
        break;
      case Kind::kBroadcast: comm.broadcast(a_, root_); break;
      case Kind::kAllGather: comm.all_gather(a_, b_); break;
      case Kind::kBarrier: comm.barrier(); break;
      case Kind::kReduceScatter: {
        comm.reduce_scatter_sum(a_);
        if (op_ != ReduceOp::kAverage) break;
        // Only this rank's chunk is the sum: the rest is partial sums.
        const std::vector<size_t> bounds = ring_chunks(a_.numel, dtype_size(a_.dtype), world_);
        const size_t lo = bounds[comm.rank()], hi = bounds[comm.rank() + 1];
        scale_in_place(a_.dtype, static_cast<char*>(a_.data) + lo * dtype_size(a_.dtype),
                       hi - lo, 1.0 / world_);
        break;
      }
      case Kind::kAllGatherChunks: comm.all_gather_chunks(segments_, bounds_); break;
      case Kind::kReduceScatterCoded: {
        BlockScratch scratch;  // (per call: a bucket's records, freed with the work)
        float* data = static_cast<float*>(a_.data);
        float* residual = static_cast<float*>(b_.data);
        if (coding_ == Compression::kInt8) {
          reduce_scatter_in_blocks<Int8Codes>(data, residual, a_.numel, comm, scratch);
        } else {
          reduce_scatter_in_blocks<Int4Codes>(data, residual, a_.numel, comm, scratch);
        }
        break;
      }
    }
    timeline.record("comm", describe(), "collective", start, timeline.now_us());
  }

  std::string describe() const override {
    std::ostringstream out;
    switch (kind_) {
      case Kind::kAllReduce:
        out << (op_ == ReduceOp::kAverage ? "all_reduce(avg)" : "all_reduce(sum)");
        break;
      case Kind::kBroadcast: out << "broadcast(root " << root_ << ")"; break;
      case Kind::kAllGather: out << "all_gather"; break;
      case Kind::kBarrier: return "barrier";
      case Kind::kReduceScatter:
        out << (op_ == ReduceOp::kAverage ? "reduce_scatter(avg)" : "reduce_scatter(sum)");
        break;
      case Kind::kAllGatherChunks: out << "all_gather_chunks"; break;
      case Kind::kReduceScatterCoded:
        out << "reduce_scatter(avg, " << (coding_ == Compression::kInt8 ? "int8" : "int4") << ")";
        break;
    }
    out << " of " << a_.numel << " " << dtype_name(a_.dtype);
    return out.str();
  }

 private:
  Kind kind_;
  TensorRef a_, b_;
  ReduceOp op_;
  int root_;
  int world_;
  std::vector<size_t> bounds_;  // all_gather_chunks: the chunks (empty: the ring's)
  std::vector<TensorRef> segments_;  // all_gather_chunks: what the tensor is made of
  Compression coding_;  // reduce_scatter_coded: int8 or int4
};

// After a transport failure: every surviving rank announces through the store
// that it reached the failed operation, then waits a short grace period for
// the others. Ranks that never announce are dead or stalled before it. A
// rank whose failure surfaced on its other lane (the preview's, or the
// main one) never reaches this lane's operation: it announces that it is
// alive, and is not counted as missing.
std::string diagnose_missing_ranks(const std::weak_ptr<Store>& weak_store, const std::string& lane,
                                   int rank, int world, double timeout_s, uint64_t sequence) {
  const std::shared_ptr<Store> store = weak_store.lock();
  if (world <= 1 || !store) return {};
  const std::string prefix = "hemiola_failure/" + lane + std::to_string(sequence) + "/";
  const std::string alive = "hemiola_failure/alive/";
  try {
    store->set(prefix + std::to_string(rank), "reached");
    store->set(alive + std::to_string(rank), lane + std::to_string(sequence));
  } catch (const std::exception& e) {
    return std::string(" (could not tell which ranks are missing: the store is unreachable: ") +
           e.what() + ")";
  }
  const auto grace = std::chrono::milliseconds(
      static_cast<int64_t>(1000.0 * std::min(10.0, std::max(1.0, timeout_s))));
  const auto deadline = std::chrono::steady_clock::now() + grace;
  std::vector<int> missing;
  for (int r = 0; r < world; ++r) {
    if (r == rank) continue;
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - std::chrono::steady_clock::now()));
    try {
      store->get(prefix + std::to_string(r), left);
    } catch (const std::exception&) {
      try {
        store->get(alive + std::to_string(r), std::chrono::milliseconds(1));
      } catch (const std::exception&) {
        missing.push_back(r);
      }
    }
  }
  std::ostringstream out;
  if (missing.empty()) {
    out << " (every other rank reached this operation or failed elsewhere; the transport "
           "itself failed)";
  } else {
    out << ". Ranks missing (dead, or stalled before operation #" << sequence << "): [";
    for (size_t i = 0; i < missing.size(); ++i) out << (i ? ", " : "") << missing[i];
    out << "]";
  }
  return out.str();
}

}  // namespace

EngineImpl::EngineImpl(const EngineOptions& options, std::shared_ptr<Store> store)
    : options_(options), store_(std::move(store)), timeline_(options.timeline) {
  HEMIOLA_CHECK(store_ != nullptr || options_.world_size == 1,
                "an engine with world_size > 1 needs a store for rendezvous");
  rendezvous_ = store_;
  if (!rendezvous_) rendezvous_ = std::make_shared<MemoryStore>();
  comm_ = std::make_unique<GlooCommunicator>(options_, *rendezvous_);
  devices_ = std::make_unique<Devices>(options_, *rendezvous_, *comm_);
  wires_.push_back(Wire{"", nullptr, make_wire_thread(*comm_, "")});
}

std::unique_ptr<WireThread> EngineImpl::make_wire_thread(Communicator& comm,
                                                      const std::string& lane) {
  // Weak: handles may outlive the engine, and must not keep a (possibly
  // Python-implemented) store alive from an engine thread.
  if (!options_.diagnose_failures) {
    return std::make_unique<WireThread>(comm, timeline_, [](uint64_t) { return std::string(); });
  }
  std::weak_ptr<Store> diag_store = store_;
  const int rank = options_.rank, world = options_.world_size;
  const double timeout_s = options_.timeout_s;
  return std::make_unique<WireThread>(
      comm, timeline_, [diag_store, lane, rank, world, timeout_s](uint64_t sequence) {
        return diagnose_missing_ranks(diag_store, lane, rank, world, timeout_s, sequence);
      });
}

EngineImpl::~EngineImpl() {
  // Join the threads: nothing uses the devices or communicators after this.
  for (auto it = wires_.rbegin(); it != wires_.rend(); ++it) it->thread.reset();
  devices_.reset();
}

size_t EngineImpl::connect_wire(const std::string& name) {
  HEMIOLA_CHECK(!name.empty(), "a wire needs a name");
  std::lock_guard<std::mutex> lock(wires_mutex_);
  for (size_t w = 0; w < wires_.size(); ++w) {
    if (wires_[w].name == name) return w;
  }
  Wire wire{name, std::make_unique<GlooCommunicator>(
                      options_, *std::make_shared<PrefixStore>("hemiola_" + name, rendezvous_)),
            nullptr};
  wire.thread = make_wire_thread(*wire.comm, name + "/");
  wires_.push_back(std::move(wire));
  return wires_.size() - 1;
}

Handle EngineImpl::submit(size_t wire, std::shared_ptr<Work> work) {
  WireThread* thread;
  {
    std::lock_guard<std::mutex> lock(wires_mutex_);
    HEMIOLA_CHECK(wire < wires_.size(), "wire ", wire, " is not connected");
    thread = wires_[wire].thread.get();
  }
  return thread->submit(std::move(work));
}

Engine::Engine(const EngineOptions& options, std::shared_ptr<Store> store)
    : impl_(std::make_unique<EngineImpl>(options, std::move(store))) {}

Engine::~Engine() = default;

int Engine::rank() const { return impl_->options().rank; }
int Engine::world_size() const { return impl_->options().world_size; }
const EngineOptions& Engine::options() const { return impl_->options(); }
std::string Engine::transport() const { return impl_->comm().name(); }

Handle EngineImpl::all_reduce(const TensorRef& tensor, ReduceOp op) {
  HEMIOLA_CHECK(is_floating(tensor.dtype) || op == ReduceOp::kSum, "all_reduce average of ",
                dtype_name(tensor.dtype), ": only floating dtypes can be averaged");
  return submit(std::make_shared<CollectiveWork>(CollectiveWork::Kind::kAllReduce, tensor,
                                                 TensorRef{}, op, 0, options_.world_size));
}

Handle EngineImpl::broadcast(const TensorRef& tensor, int root) {
  HEMIOLA_CHECK(root >= 0 && root < options_.world_size, "broadcast root ", root,
                " is outside [0, ", options_.world_size, ")");
  return submit(std::make_shared<CollectiveWork>(CollectiveWork::Kind::kBroadcast, tensor,
                                                 TensorRef{}, ReduceOp::kSum, root,
                                                 options_.world_size));
}

Handle EngineImpl::all_gather(const TensorRef& input, const TensorRef& output) {
  HEMIOLA_CHECK(input.dtype == output.dtype, "all_gather: input is ", dtype_name(input.dtype),
                " but output is ", dtype_name(output.dtype));
  HEMIOLA_CHECK(output.numel == input.numel * static_cast<size_t>(options_.world_size),
                "all_gather: output has ", output.numel, " elements, expected world_size (",
                options_.world_size, ") * ", input.numel);
  return submit(std::make_shared<CollectiveWork>(CollectiveWork::Kind::kAllGather, input, output,
                                                 ReduceOp::kSum, 0, options_.world_size));
}

Handle EngineImpl::reduce_scatter(const TensorRef& tensor, ReduceOp op) {
  HEMIOLA_CHECK(is_floating(tensor.dtype) || op == ReduceOp::kSum, "reduce_scatter average of ",
                dtype_name(tensor.dtype), ": only floating dtypes can be averaged");
  return submit(std::make_shared<CollectiveWork>(CollectiveWork::Kind::kReduceScatter, tensor,
                                                 TensorRef{}, op, 0, options_.world_size));
}

Handle EngineImpl::all_gather_chunks(std::vector<TensorRef> segments,
                                     std::vector<size_t> bounds) {
  HEMIOLA_CHECK(!segments.empty(), "all_gather_chunks: no segments");
  size_t numel = 0;
  for (const TensorRef& segment : segments) numel += segment.numel;
  TensorRef whole = segments.front();
  whole.numel = numel;  // (for the description)
  return submit(std::make_shared<CollectiveWork>(CollectiveWork::Kind::kAllGatherChunks, whole,
                                                 TensorRef{}, ReduceOp::kSum, 0,
                                                 options_.world_size, std::move(bounds),
                                                 std::move(segments)));
}

Handle EngineImpl::reduce_scatter_coded(const TensorRef& tensor, const TensorRef& residual,
                                        Compression coding) {
  HEMIOLA_CHECK(coding == Compression::kInt8 || coding == Compression::kInt4,
                "reduce_scatter_coded: the coding must be int8 or int4");
  HEMIOLA_CHECK(tensor.dtype == DType::kFloat32 && residual.dtype == DType::kFloat32,
                "reduce_scatter_coded: float32 tensors only, got ", dtype_name(tensor.dtype),
                " and a ", dtype_name(residual.dtype), " residual");
  HEMIOLA_CHECK(residual.numel == tensor.numel, "reduce_scatter_coded: the residual has ",
                residual.numel, " elements, the tensor ", tensor.numel);
  HEMIOLA_CHECK(tensor.device.type == DeviceType::kCPU && residual.device.type == DeviceType::kCPU,
                "reduce_scatter_coded: CPU tensors only (the Gloo wire)");
  return submit(std::make_shared<CollectiveWork>(
      CollectiveWork::Kind::kReduceScatterCoded, tensor, residual, ReduceOp::kAverage, 0,
      options_.world_size, std::vector<size_t>{}, std::vector<TensorRef>{}, coding));
}

Handle EngineImpl::barrier() {
  return submit(std::make_shared<CollectiveWork>(CollectiveWork::Kind::kBarrier, TensorRef{},
                                                 TensorRef{}, ReduceOp::kSum, 0,
                                                 options_.world_size));
}

Handle Engine::all_reduce(const TensorRef& tensor, ReduceOp op) {
  return impl_->all_reduce(tensor, op);
}
Handle Engine::broadcast(const TensorRef& tensor, int root) { return impl_->broadcast(tensor, root); }
Handle Engine::all_gather(const TensorRef& input, const TensorRef& output) {
  return impl_->all_gather(input, output);
}
Handle Engine::barrier() { return impl_->barrier(); }
Handle Engine::reduce_scatter(const TensorRef& tensor, ReduceOp op) {
  return impl_->reduce_scatter(tensor, op);
}
Handle Engine::all_gather_chunks(const TensorRef& tensor, std::vector<size_t> bounds) {
  return impl_->all_gather_chunks({tensor}, std::move(bounds));
}
Handle Engine::all_gather_chunks(std::vector<TensorRef> segments, std::vector<size_t> bounds) {
  return impl_->all_gather_chunks(std::move(segments), std::move(bounds));
}

std::vector<size_t> chunk_bounds(size_t numel, DType dtype, int world_size) {
  return ring_chunks(numel, dtype_size(dtype), world_size);
}

Handle Engine::reduce_scatter_coded(const TensorRef& tensor, const TensorRef& residual,
                                    Compression coding) {
  return impl_->reduce_scatter_coded(tensor, residual, coding);
}

std::vector<size_t> coded_chunk_bounds(size_t numel, int world_size) {
  HEMIOLA_CHECK(world_size >= 1, "coded_chunk_bounds: world_size must be at least 1");
  const block_coding::BlockChunks chunks(numel, static_cast<size_t>(world_size));
  std::vector<size_t> bounds(chunks.ranks + 1);
  for (size_t r = 0; r <= chunks.ranks; ++r) bounds[r] = chunks.bound(r);
  return bounds;
}

std::unique_ptr<Reducer> Engine::make_reducer(const std::vector<GradSpec>& specs,
                                              const ReducerOptions& options) {
  return std::make_unique<Reducer>(std::make_unique<ReducerImpl>(*impl_, specs, options));
}

std::unique_ptr<Streamer> Engine::make_streamer(std::vector<StreamedParameter> params,
                                                const StreamerOptions& options, Engine* group) {
  HEMIOLA_CHECK(group != this, "make_streamer: the group engine must be another engine (the "
                "replica group's ranks), not the one that averages across groups");
  return std::make_unique<Streamer>(std::make_unique<StreamerImpl>(
      *impl_, std::move(params), options, group == nullptr ? nullptr : &group->impl()));
}

// Here, not in streamer.cpp: the streaming floor does not see the engine.
void Streamer::rejoin(Engine& across, bool redo) { impl_->rejoin(across.impl(), redo); }

std::string Engine::timeline_json() const { return impl_->timeline().json(rank()); }

void Engine::timeline_record(const std::string& lane, const std::string& name,
                             const std::string& category, int64_t start_us, int64_t end_us) {
  impl_->timeline().record(lane, name, category, start_us, end_us);
}

int64_t Engine::timeline_now_us() const { return impl_->timeline().now_us(); }

}  // namespace hemiola
