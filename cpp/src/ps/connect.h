// The worker's side of the handshake (the server's is ps/admission.h).
#pragma once

#include <chrono>
#include <string>

#include "hemiola/store.h"
#include "ps/socket.h"

namespace hemiola::ps {

// Connects to the server published under address_key(server_index), says
// hello as `worker` with `token`, and returns the socket once welcomed.
// Retries until `timeout` while the server cannot be reached or closes the
// connection without an answer. Throws Error(kAborted) with the server's
// reason when refused, Error(kTimeout) when the server cannot be reached in
// time.
Socket connect_to_server(Store& store, int server_index, int worker, const std::string& token,
                         std::chrono::milliseconds timeout, const std::string& server_name);

}  // namespace hemiola::ps
