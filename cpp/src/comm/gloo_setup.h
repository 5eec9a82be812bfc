// Shared Gloo set-up: binding a TCP device and connecting a context through a
// hemiola Store. Used by the collective communicator and by the parameter
// server's point-to-point channels.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "hemiola/store.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}
}  // namespace gloo

namespace hemiola {

// Where to bind: an interface name, else an address, else the local address
// that routes to master_addr (loopback when alone).
struct BindSpec {
  std::string iface;
  std::string hostname;
  std::string master_addr;
  bool alone = false;
};

// Binds a Gloo TCP device; `address` receives a description for messages.
std::shared_ptr<gloo::transport::Device> make_gloo_device(const BindSpec& spec,
                                                          std::string* address);

// Rendezvous `rank` of `size` through `store` and connect a full mesh.
std::shared_ptr<gloo::Context> connect_gloo_context(
    int rank, int size, Store& store, std::shared_ptr<gloo::transport::Device> device,
    std::chrono::milliseconds timeout);

}  // namespace hemiola
