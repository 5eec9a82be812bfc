// Where a parameter server is found: the address it binds, and the store
// entry through which it tells the workers that address (or why it could not
// start). The server writes the entry, connect_to_server reads it; both use
// this file, so the format lives in one place.
#pragma once

#include <chrono>
#include <string>

#include "comm/gloo_setup.h"
#include "hemiola/store.h"

namespace hemiola::ps {

// The address a server binds, from the same choice the engine makes for Gloo:
// the interface `spec.iface`'s address, else `spec.hostname`, else the local
// address that routes to master_addr, else the host name's address. Never the
// wildcard address unless the caller named it.
std::string bind_address(const BindSpec& spec);

// The store key under which server `server_index` publishes its address
// ("HOST PORT"), or, if it failed to start, startup_failure(why).
std::string address_key(int server_index);
std::string startup_failure(const std::string& why);

struct ServerAddress {
  std::string host;
  std::string port;
};

// Waits up to `timeout` for server `server_index`'s entry and returns its
// address. Throws Error(kInvalidArgument) when the server published that it
// failed to start; the store's get() decides what waiting in vain throws.
ServerAddress published_address(Store& store, int server_index, std::chrono::milliseconds timeout,
                                const std::string& server_name);

}  // namespace hemiola::ps
