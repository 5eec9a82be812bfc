// Picking the local address that peers can reach.
#pragma once

#include <string>

namespace hemiola {

// The local IP address of the interface that routes to `host` (found by
// connecting a UDP socket, which sends nothing). Empty when `host` does not
// resolve or has no route.
std::string local_address_reaching(const std::string& host);

}  // namespace hemiola
