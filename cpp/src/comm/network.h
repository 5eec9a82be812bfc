// Picking the local address that peers can reach.
#pragma once

#include <string>

namespace hemiola {

// The local IP address of the interface that routes to `host` (found by
// connecting a UDP socket, which sends nothing). Empty when `host` does not
// resolve or has no route.
std::string local_address_reaching(const std::string& host);

// The name of the local interface that holds `address` (e.g. "eth0"), or empty.
std::string interface_with_address(const std::string& address);

// The IP address of interface `iface` that a peer can connect to: its first
// IPv4 address, else its first IPv6 address that is not link-local (that one
// needs a scope id). Empty when the interface does not exist or has neither.
std::string address_of_interface(const std::string& iface);

}  // namespace hemiola
