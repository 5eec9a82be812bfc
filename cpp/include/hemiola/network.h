// Network helpers: which local interface reaches a peer.
#pragma once

#include <string>

#include "hemiola/export.h"

namespace hemiola {

// The local interface (e.g. "eth0") whose address routes to `host` (a name or
// an address, e.g. torchrun's MASTER_ADDR); empty when there is none. This is
// what the engine binds when no interface or host name is configured.
HEMIOLA_API std::string interface_reaching(const std::string& host);

}  // namespace hemiola
