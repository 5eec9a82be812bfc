#include "comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/context.h>

#include "comm/gloo_setup.h"
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

GlooCommunicator::GlooCommunicator(const EngineOptions& options, Store& store)
    : rank_(options.rank),
      size_(options.world_size),
      timeout_(std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000.0))) {
  HEMIOLA_CHECK(size_ >= 1, "world_size must be >= 1, got ", size_);
  HEMIOLA_CHECK(rank_ >= 0 && rank_ < size_, "rank ", rank_, " is outside [0, ", size_, ")");
  HEMIOLA_CHECK(options.timeout_s > 0, "timeout_s must be positive, got ", options.timeout_s);

  BindSpec spec{options.iface, options.hostname, options.master_addr, size_ == 1};
  context_ = connect_gloo_context(rank_, size_, store, make_gloo_device(spec, &address_),
                                  timeout_);
}

GlooCommunicator::~GlooCommunicator() = default;

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
}

void GlooCommunicator::all_reduce_sum(const TensorRef& t) {
  require_cpu(t, "all_reduce");
  if (t.numel == 0 || size_ == 1) return;
  translate_gloo_errors("all_reduce", &t, rank_, [&] {
    gloo::AllreduceOptions opts(context("all_reduce"));
    opts.setTimeout(timeout_);
    opts.setReduceFunction(reduce_function(t.dtype));
    switch (dtype_size(t.dtype)) {
      case 1: opts.setOutput(static_cast<uint8_t*>(t.data), t.numel); break;
      case 2: opts.setOutput(static_cast<uint16_t*>(t.data), t.numel); break;
      case 4: opts.setOutput(static_cast<uint32_t*>(t.data), t.numel); break;
      case 8: opts.setOutput(static_cast<uint64_t*>(t.data), t.numel); break;
      default: HEMIOLA_THROW(ErrorCode::kInternal, "unexpected element size");
    }
    gloo::allreduce(opts);
  });
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

void GlooCommunicator::barrier() {
  if (size_ == 1) return;
  translate_gloo_errors("barrier", nullptr, rank_, [&] {
    gloo::BarrierOptions opts(context("barrier"));
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
  });
}

}  // namespace hemiola
