// NCCL communicator for one device of one rank.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/device_communicator.h"
#include "comm/nccl_library.h"
#include "hemiola/store.h"

namespace hemiola {

// Creates the communicator of `rank` among `size` ranks on CUDA `device`:
// rank 0 makes the unique id and publishes it under `key` in `store`, the
// others read it (waiting up to `timeout`), then all initialise together
// (collective: every rank must call this, in the same order relative to its
// other collectives). `nccl` must outlive the communicator.
std::unique_ptr<DeviceCommunicator> make_nccl_communicator(const comm::NcclLibrary& nccl,
                                                           Store& store, const std::string& key,
                                                           int rank, int size, int device,
                                                           std::chrono::milliseconds timeout);

}  // namespace hemiola
