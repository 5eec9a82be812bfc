// The engine's per-device state: for each CUDA device it reduces on, a
// communication stream and a device communicator (NCCL, or Gloo staged
// through pinned memory), created on first use and cached.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "cuda/device.h"
#include "hemiola/config.h"
#include "hemiola/store.h"

namespace hemiola {

class Devices {
 public:
  struct Entry {
    explicit Entry(int device) : stream(device) {}
    cuda::Stream stream;  // the engine's communication stream on the device
    std::unique_ptr<DeviceCommunicator> comm;
  };

  // `host` is the engine's Gloo communicator (the staged fallback reduces
  // through it); `store` is where NCCL unique ids are exchanged. Both must
  // outlive this object.
  Devices(const EngineOptions& options, Store& store, Communicator& host);
  ~Devices();

  // Device `device`'s entry. The main wire's thread only: creating a
  // communicator is a collective, so it must happen at the same point of the
  // submission order on every rank, which that thread guarantees.
  Entry& get(int device);

 private:
  struct Nccl;  // the dlopen'ed library, when this build has the NCCL loader
  std::unique_ptr<DeviceCommunicator> make_comm(int device);

  const EngineOptions& options_;
  Store& store_;
  Communicator& host_;
  std::unique_ptr<Nccl> nccl_;
  std::map<int, std::unique_ptr<Entry>> entries_;
  int communicators_made_ = 0;  // names each NCCL unique id's store key
};

}  // namespace hemiola
