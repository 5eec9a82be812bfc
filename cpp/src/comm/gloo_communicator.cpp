#include "comm/gloo_communicator.h"

#include <condition_variable>
#include <cstring>
#include <exception>
#include <algorithm>
#include <functional>
#include <memory>
#include <vector>
#include <mutex>
#include <thread>

#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "comm/gloo_setup.h"
#include "comm/ring_chunks.h"
#include "core/dtype_math.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

// Gloo throws its own exception types; turn them into ours with the op named.
template <typename Fn>
void translate_gloo_errors(const char* op, const TensorRef* tensor, int rank, Fn&& fn) {
  try {
    fn();
  } catch (const hemiola::Error&) {
    throw;
  } catch (const gloo::IoException& e) {
    const std::string what = e.what();
    const bool timed_out = what.find("imed out") != std::string::npos ||
                           what.find("imeout") != std::string::npos;
    HEMIOLA_THROW(timed_out ? ErrorCode::kTimeout : ErrorCode::kCommFailure, "rank ", rank,
                  ": gloo ", op, tensor ? " of " : "",
                  tensor ? std::to_string(tensor->nbytes()) + " bytes" : std::string(),
                  " failed: ", what);
  } catch (const gloo::Exception& e) {
    HEMIOLA_THROW(ErrorCode::kCommFailure, "rank ", rank, ": gloo ", op, " failed: ", e.what());
  } catch (const std::exception& e) {  // gloo::EnforceNotMet and friends
    HEMIOLA_THROW(ErrorCode::kCommFailure, "rank ", rank, ": gloo ", op, " failed: ", e.what());
  }
}

gloo::AllreduceOptions::Func reduce_function(DType dtype) {
  return [dtype](void* out, const void* a, const void* b, size_t n) {
    sum_into(dtype, out, a, b, n);
  };
}

void require_cpu(const TensorRef& t, const char* op) {
  HEMIOLA_CHECK(t.device.type == DeviceType::kCPU, "gloo ", op,
                ": tensor is on a CUDA device; this build's Gloo path takes CPU tensors only");
  HEMIOLA_CHECK(t.data != nullptr || t.numel == 0, "gloo ", op, ": null data pointer");
}

}  // namespace

// One stripe's thread: runs one part of a striped all-reduce at a time.
class StripeThread {
 public:
  StripeThread() : thread_([this] { loop(); }) {}
  ~StripeThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Starts `job`; the caller must finish() before the next start().
  void start(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = std::move(job);
      done_ = false;
      error_ = nullptr;
    }
    cv_.notify_all();
  }
  // Blocks until the started job has run; its exception, if it threw.
  std::exception_ptr finish() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return done_; });
    return error_;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || job_; });
      if (stop_) return;
      std::function<void()> job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      error_ = error;
      done_ = true;
      cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::function<void()> job_;  // set by start(), taken by the thread
  bool done_ = true;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts once the state above exists
};

GlooCommunicator::GlooCommunicator(const EngineOptions& options, Store& store)
    : rank_(options.rank),
      size_(options.world_size),
      timeout_(std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000.0))) {
  HEMIOLA_CHECK(size_ >= 1, "world_size must be >= 1, got ", size_);
  HEMIOLA_CHECK(rank_ >= 0 && rank_ < size_, "rank ", rank_, " is outside [0, ", size_, ")");
  HEMIOLA_CHECK(options.timeout_s > 0, "timeout_s must be positive, got ", options.timeout_s);

  HEMIOLA_CHECK(options.gloo_stripes >= 1 && options.gloo_stripes <= 16,
                "gloo_stripes (HEMIOLA_GLOO_STRIPES) must be between 1 and 16, got ",
                options.gloo_stripes);

  BindSpec spec{options.iface, options.hostname, options.master_addr, size_ == 1};
  context_ = connect_gloo_context(rank_, size_, store, make_gloo_device(spec, &address_),
                                  timeout_);
  if (size_ == 1) return;
  check_stripes_agree(options.gloo_stripes);
  // Each stripe rendezvouses under its own keys; the caller's store outlives
  // the constructor, which is all the rendezvous needs.
  std::shared_ptr<Store> borrowed(&store, [](Store*) {});
  for (int k = 1; k < options.gloo_stripes; ++k) {
    PrefixStore stripe_store("gloo_stripe" + std::to_string(k), borrowed);
    stripe_contexts_.push_back(
        connect_gloo_context(rank_, size_, stripe_store, make_gloo_device(spec, nullptr),
                             timeout_));
  }
  for (size_t k = 0; k < stripe_contexts_.size(); ++k) {
    stripe_threads_.push_back(std::make_unique<StripeThread>());
  }
}

GlooCommunicator::~GlooCommunicator() = default;

std::string GlooCommunicator::name() const {
  std::string name = "gloo/tcp " + address_;
  if (!stripe_contexts_.empty()) {
    name += " (" + std::to_string(stripe_contexts_.size() + 1) + " stripes)";
  }
  return name;
}

void GlooCommunicator::check_stripes_agree(int stripes) {
  std::vector<int32_t> all(static_cast<size_t>(size_));
  int32_t mine = stripes;
  translate_gloo_errors("all_gather", nullptr, rank_, [&] {
    gloo::AllgatherOptions opts(context_);
    opts.setTimeout(timeout_);
    opts.setInput(&mine, 1);
    opts.setOutput(all.data(), all.size());
    gloo::allgather(opts);
  });
  for (int r = 0; r < size_; ++r) {
    HEMIOLA_CHECK(all[static_cast<size_t>(r)] == stripes, "rank ", rank_, " has gloo_stripes ",
                  stripes, " but rank ", r, " has ", all[static_cast<size_t>(r)],
                  ": set HEMIOLA_GLOO_STRIPES alike on every rank");
  }
}

const std::shared_ptr<gloo::Context>& GlooCommunicator::context(const char* what) const {
  if (!context_) {
    HEMIOLA_THROW(ErrorCode::kCommFailure, what, " on rank ", rank_,
                  ": this communicator was closed after an earlier failure");
  }
  return context_;
}

void GlooCommunicator::abort() {
  // Destroying the context closes every pair's socket: a peer blocked on a
  // receive from this rank sees the connection close at once.
  context_.reset();
  for (auto& context : stripe_contexts_) context.reset();
}

void GlooCommunicator::all_reduce_part(const std::shared_ptr<gloo::Context>& context,
                                       DType dtype, void* data, size_t numel) {
  gloo::AllreduceOptions opts(context);
  opts.setTimeout(timeout_);
  opts.setReduceFunction(reduce_function(dtype));
  switch (dtype_size(dtype)) {
    case 1: opts.setOutput(static_cast<uint8_t*>(data), numel); break;
    case 2: opts.setOutput(static_cast<uint16_t*>(data), numel); break;
    case 4: opts.setOutput(static_cast<uint32_t*>(data), numel); break;
    case 8: opts.setOutput(static_cast<uint64_t*>(data), numel); break;
    default: HEMIOLA_THROW(ErrorCode::kInternal, "unexpected element size");
  }
  gloo::allreduce(opts);
}

void GlooCommunicator::all_reduce_sum(const TensorRef& t) {
  require_cpu(t, "all_reduce");
  if (t.numel == 0 || size_ == 1) return;
  const size_t stripes = stripe_contexts_.size() + 1;
  if (stripes == 1 || t.nbytes() < stripes * kMinStripeBytes) {
    translate_gloo_errors("all_reduce", &t, rank_,
                          [&] { all_reduce_part(context("all_reduce"), t.dtype, t.data, t.numel); });
    return;
  }
  // Part k is elements [k * n / K, (k + 1) * n / K): part 0 here, the others
  // on their stripes' threads, all on the wire at once.
  const size_t elem = dtype_size(t.dtype);
  auto bounds = [&](size_t k) { return t.numel * k / stripes; };
  const std::shared_ptr<gloo::Context> first = context("all_reduce");
  for (size_t k = 1; k < stripes; ++k) {
    const std::shared_ptr<gloo::Context> stripe = stripe_contexts_[k - 1];
    char* data = static_cast<char*>(t.data) + bounds(k) * elem;
    const size_t numel = bounds(k + 1) - bounds(k);
    stripe_threads_[k - 1]->start([this, stripe, dtype = t.dtype, data, numel] {
      all_reduce_part(stripe, dtype, data, numel);
    });
  }
  std::exception_ptr error;
  try {
    all_reduce_part(first, t.dtype, t.data, bounds(1));
  } catch (...) {
    error = std::current_exception();
  }
  // Every part must have returned before the caller may touch the tensor
  // again; a failed part's peers fail at their own timeout at the latest.
  for (auto& thread : stripe_threads_) {
    std::exception_ptr part_error = thread->finish();
    if (!error) error = part_error;
  }
  if (error) {
    translate_gloo_errors("all_reduce", &t, rank_, [&] { std::rethrow_exception(error); });
  }
}

void GlooCommunicator::broadcast(const TensorRef& t, int root) {
  require_cpu(t, "broadcast");
  HEMIOLA_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is outside [0, ", size_, ")");
  if (t.numel == 0 || size_ == 1) return;
  translate_gloo_errors("broadcast", &t, rank_, [&] {
    gloo::BroadcastOptions opts(context("broadcast"));
    opts.setTimeout(timeout_);
    opts.setRoot(root);
    opts.setOutput(static_cast<uint8_t*>(t.data), t.nbytes());
    gloo::broadcast(opts);
  });
}

void GlooCommunicator::all_gather(const TensorRef& input, const TensorRef& output) {
  require_cpu(input, "all_gather");
  require_cpu(output, "all_gather");
  HEMIOLA_CHECK(input.dtype == output.dtype, "all_gather: input and output dtypes differ");
  HEMIOLA_CHECK(output.numel == input.numel * static_cast<size_t>(size_), "all_gather: output has ",
                output.numel, " elements, expected world_size * ", input.numel);
  if (input.numel == 0) return;
  translate_gloo_errors("all_gather", &input, rank_, [&] {
    gloo::AllgatherOptions opts(context("all_gather"));
    opts.setTimeout(timeout_);
    opts.setInput(static_cast<uint8_t*>(input.data), input.nbytes());
    opts.setOutput(static_cast<uint8_t*>(output.data), output.nbytes());
    gloo::allgather(opts);
  });
}

void GlooCommunicator::all_to_all(const TensorRef& input, const TensorRef& output) {
  require_cpu(input, "all_to_all");
  require_cpu(output, "all_to_all");
  HEMIOLA_CHECK(input.dtype == output.dtype && input.numel == output.numel,
                "all_to_all: input and output differ in dtype or size");
  HEMIOLA_CHECK(input.numel % static_cast<size_t>(size_) == 0, "all_to_all: ", input.numel,
                " elements are not ", size_, " equal chunks");
  if (input.numel == 0) return;
  if (size_ == 1) {
    std::memcpy(output.data, input.data, input.nbytes());
    return;
  }
  translate_gloo_errors("all_to_all", &input, rank_, [&] {
    gloo::AlltoallOptions opts(context("all_to_all"));
    opts.setTimeout(timeout_);
    opts.setInput(static_cast<uint8_t*>(input.data), input.nbytes());
    opts.setOutput(static_cast<uint8_t*>(output.data), output.nbytes());
    gloo::alltoall(opts);
  });
}

namespace {

// Slot prefixes of the ring collectives below (Gloo's own end at 0x08).
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;
constexpr uint8_t kAllGatherChunksSlotPrefix = 0x42;

}  // namespace

void GlooCommunicator::reduce_scatter_sum(const TensorRef& t) {
  require_cpu(t, "reduce_scatter");
  if (t.numel == 0 || size_ == 1) return;
  translate_gloo_errors("reduce_scatter", &t, rank_, [&] {
    const std::shared_ptr<gloo::Context>& ctx = context("reduce_scatter");
    const size_t elem = dtype_size(t.dtype);
    const std::vector<size_t> bounds = ring_chunks(t.numel, elem, size_);
    size_t widest = 0;
    for (int r = 0; r < size_; ++r) widest = std::max(widest, bounds[r + 1] - bounds[r]);
    std::vector<uint8_t> received(widest * elem);
    auto data = ctx->createUnboundBuffer(t.data, t.nbytes());
    auto scratch = ctx->createUnboundBuffer(received.data(), received.size());
    const auto slot = gloo::Slot::build(kReduceScatterSlotPrefix, 0);
    // Gloo's ring: a rank sends to rank - 1 and receives from rank + 1, so
    // chunk c starts at rank c - 1 and collects c - 2, c - 3, ... c in turn.
    // At step k this rank passes on the partial sum of chunk rank + 1 + k
    // (its own value at k = 0, the one it summed at step k - 1 after) and
    // adds its value to the partial sum of chunk rank + 2 + k; the last is
    // chunk rank, complete.
    const int to = (rank_ + size_ - 1) % size_;
    const int from = (rank_ + 1) % size_;
    char* base = static_cast<char*>(t.data);
    for (int k = 0; k + 1 < size_; ++k) {
      const int send = (rank_ + 1 + k) % size_;
      const int recv = (rank_ + 2 + k) % size_;
      const size_t send_n = bounds[send + 1] - bounds[send];
      const size_t recv_n = bounds[recv + 1] - bounds[recv];
      if (recv_n > 0) scratch->recv(from, slot, 0, recv_n * elem);
      if (send_n > 0) data->send(to, slot, bounds[send] * elem, send_n * elem);
      if (recv_n > 0) {
        scratch->waitRecv(timeout_);
        char* mine = base + bounds[recv] * elem;
        sum_into(t.dtype, mine, mine, received.data(), recv_n);
      }
      if (send_n > 0) data->waitSend(timeout_);
    }
  });
}

void GlooCommunicator::all_gather_chunks(const std::vector<TensorRef>& segments,
                                         const std::vector<size_t>& given) {
  HEMIOLA_CHECK(!segments.empty(), "all_gather_chunks: no segments");
  const DType dtype = segments.front().dtype;
  size_t numel = 0;
  // starts[i]: segment i's first element in the concatenation.
  std::vector<size_t> starts;
  for (const TensorRef& segment : segments) {
    require_cpu(segment, "all_gather_chunks");
    HEMIOLA_CHECK(segment.dtype == dtype, "all_gather_chunks: segments of ", dtype_name(dtype),
                  " and ", dtype_name(segment.dtype));
    starts.push_back(numel);
    numel += segment.numel;
  }
  if (!given.empty()) {
    HEMIOLA_CHECK(given.size() == static_cast<size_t>(size_) + 1 && given.front() == 0 &&
                      given.back() == numel && std::is_sorted(given.begin(), given.end()),
                  "all_gather_chunks: the chunk bounds must be ", size_ + 1,
                  " non-decreasing offsets from 0 to ", numel);
  }
  if (numel == 0 || size_ == 1) return;
  translate_gloo_errors("all_gather_chunks", &segments.front(), rank_, [&] {
    const std::shared_ptr<gloo::Context>& ctx = context("all_gather_chunks");
    const size_t elem = dtype_size(dtype);
    const std::vector<size_t> bounds = given.empty() ? ring_chunks(numel, elem, size_) : given;
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> buffers;
    for (const TensorRef& segment : segments) {
      buffers.push_back(ctx->createUnboundBuffer(segment.data, segment.nbytes()));
    }
    // The pieces of chunk c, one per segment it overlaps, in order: the same
    // on every rank (the same segments), so each send meets its receive.
    struct Piece {
      size_t segment, offset, bytes;
    };
    auto pieces = [&](int c) {
      std::vector<Piece> out;
      const size_t lo = bounds[c], hi = bounds[c + 1];
      for (size_t i = 0; i < segments.size(); ++i) {
        const size_t first = std::max(lo, starts[i]);
        const size_t last = std::min(hi, starts[i] + segments[i].numel);
        if (first < last) out.push_back({i, (first - starts[i]) * elem, (last - first) * elem});
      }
      return out;
    };
    const auto slot = gloo::Slot::build(kAllGatherChunksSlotPrefix, 0);
    // The ring of reduce_scatter_sum: at step k this rank passes on chunk
    // rank + k (its own at k = 0, the one it received at step k - 1 after)
    // and receives chunk rank + k + 1. Sends and receives touch different
    // chunks; a segment holds at most one piece of a chunk.
    const int to = (rank_ + size_ - 1) % size_;
    const int from = (rank_ + 1) % size_;
    for (int k = 0; k + 1 < size_; ++k) {
      const std::vector<Piece> sends = pieces((rank_ + k) % size_);
      const std::vector<Piece> recvs = pieces((rank_ + k + 1) % size_);
      for (const Piece& p : recvs) buffers[p.segment]->recv(from, slot, p.offset, p.bytes);
      for (const Piece& p : sends) buffers[p.segment]->send(to, slot, p.offset, p.bytes);
      for (const Piece& p : recvs) buffers[p.segment]->waitRecv(timeout_);
      for (const Piece& p : sends) buffers[p.segment]->waitSend(timeout_);
    }
  });
}

void GlooCommunicator::barrier() {
  if (size_ == 1) return;
  translate_gloo_errors("barrier", nullptr, rank_, [&] {
    gloo::BarrierOptions opts(context("barrier"));
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
  });
}

}  // namespace hemiola
