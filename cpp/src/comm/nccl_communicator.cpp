#include "comm/nccl_communicator.h"

#include <cstring>

#include "cuda/device.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kUInt8: return ncclUint8;
  }
  HEMIOLA_THROW(ErrorCode::kInternal, "unknown dtype");
}

class NcclCommunicator final : public DeviceCommunicator {
 public:
  NcclCommunicator(const comm::NcclLibrary& nccl, ncclComm_t comm, int rank, int size)
      : api_(nccl.api()), version_(nccl.version()), comm_(comm), rank_(rank), size_(size) {}

  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      if (aborted_) {
        api_.comm_abort(comm_);
      } else {
        api_.comm_destroy(comm_);
      }
    }
  }

  std::string name() const override { return "nccl " + version_; }

  void all_reduce(const TensorRef& tensor, bool average, void* stream) override {
    if (tensor.numel == 0) return;
    // ncclAvg divides in the reduction itself: no separate scaling pass.
    const ncclRedOp_t op = average ? ncclAvg : ncclSum;
    call(api_.all_reduce(tensor.data, tensor.data, tensor.numel, nccl_dtype(tensor.dtype), op,
                         comm_, static_cast<cudaStream_t>(stream)),
         "ncclAllReduce");
  }

  void check() override {
    ncclResult_t state = ncclSuccess;
    call(api_.comm_get_async_error(comm_, &state), "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress) {
      HEMIOLA_THROW(ErrorCode::kCommFailure, "rank ", rank_, " of ", size_,
                    ": NCCL failed asynchronously: ", api_.get_error_string(state),
                    " (a peer may have died; the job must be restarted)");
    }
  }

  void abort() override { aborted_ = true; }

 private:
  void call(ncclResult_t result, const char* what) const {
    if (result != ncclSuccess) {
      HEMIOLA_THROW(ErrorCode::kCommFailure, "rank ", rank_, " of ", size_, ": ", what,
                    " failed: ", api_.get_error_string(result));
    }
  }

  const comm::NcclFunctions& api_;
  std::string version_;
  ncclComm_t comm_;
  int rank_;
  int size_;
  bool aborted_ = false;
};

}  // namespace

std::unique_ptr<DeviceCommunicator> make_nccl_communicator(const comm::NcclLibrary& nccl,
                                                           Store& store, const std::string& key,
                                                           int rank, int size, int device,
                                                           std::chrono::milliseconds timeout) {
  const comm::NcclFunctions& api = nccl.api();  // throws, with the reason, when not loaded
  ncclUniqueId id;
  if (rank == 0) {
    const ncclResult_t made = api.get_unique_id(&id);
    HEMIOLA_CHECK(made == ncclSuccess, "ncclGetUniqueId failed: ", api.get_error_string(made));
    store.set(key, std::string(id.internal, sizeof(id.internal)));
  } else {
    const std::string bytes = store.get(key, timeout);
    HEMIOLA_CHECK(bytes.size() == sizeof(id.internal), "NCCL unique id under '", key, "' has ",
                  bytes.size(), " bytes, expected ", sizeof(id.internal),
                  " (ranks run different NCCL versions?)");
    std::memcpy(id.internal, bytes.data(), bytes.size());
  }
  cuda::set_device(device);
  ncclComm_t comm = nullptr;
  const ncclResult_t result = api.comm_init_rank(&comm, size, id, rank);
  if (result != ncclSuccess) {
    HEMIOLA_THROW(ErrorCode::kCommFailure, "rank ", rank, " of ", size,
                  ": ncclCommInitRank on CUDA device ", device,
                  " failed: ", api.get_error_string(result),
                  ". NCCL needs one GPU per rank; to run several ranks on one GPU, or without "
                  "NCCL, set gpu_backend='gloo'");
  }
  return std::make_unique<NcclCommunicator>(nccl, comm, rank, size);
}

}  // namespace hemiola
