#include "comm/devices.h"

#include <chrono>

#include "hemiola/build_config.h"
#include "hemiola/status.h"

#if HEMIOLA_NCCL_ENABLED
#include "comm/nccl_communicator.h"
#include "comm/nccl_library.h"
#endif

namespace hemiola {

struct Devices::Nccl {
#if HEMIOLA_NCCL_ENABLED
  comm::NcclLibrary library;
#endif
};

Devices::Devices(const EngineOptions& options, Store& store, Communicator& host)
    : options_(options), store_(store), host_(host) {
  const std::string& backend = options_.gpu_backend;
  HEMIOLA_CHECK(backend == "auto" || backend == "nccl" || backend == "gloo", "gpu_backend '",
                backend, "' is not one of 'auto', 'nccl', 'gloo'");
}

Devices::~Devices() = default;

Devices::Entry& Devices::get(int device) {
  auto found = entries_.find(device);
  if (found != entries_.end()) return *found->second;
  auto entry = std::make_unique<Entry>(device);
  entry->comm = make_comm(device);
  return *entries_.emplace(device, std::move(entry)).first->second;
}

std::unique_ptr<DeviceCommunicator> Devices::make_comm(int device) {
  const std::string& backend = options_.gpu_backend;
  if (backend == "gloo") return make_staged_gloo_communicator(host_, device, options_.staged_chunk_bytes);
#if HEMIOLA_NCCL_ENABLED
  if (!nccl_) nccl_ = std::make_unique<Nccl>();
  const comm::NcclLibrary& library = nccl_->library;
  if (library.loaded()) {
    const auto timeout =
        std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_s * 1000.0));
    const std::string key = "hemiola/nccl/" + std::to_string(communicators_made_++);
    return make_nccl_communicator(library, store_, key, options_.rank, options_.world_size,
                                  device, timeout);
  }
  HEMIOLA_CHECK(backend != "nccl", "gpu_backend='nccl' but ", library.reason());
#else
  HEMIOLA_CHECK(backend != "nccl", "gpu_backend='nccl' but this build has no NCCL loader (",
                HEMIOLA_NCCL_REASON, ")");
#endif
  // auto without NCCL: the Gloo fallback.
  return make_staged_gloo_communicator(host_, device, options_.staged_chunk_bytes);
}

}  // namespace hemiola
