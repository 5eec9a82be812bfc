// The parameter server's socket layer: an owned descriptor and the few
// blocking-socket operations both sides need. Nothing here knows the wire
// format; framing lives in ps/channel.h and ps/protocol.h.
#pragma once

#include <netdb.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace hemiola::ps {

// An owned socket descriptor (closed on destruction).
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { reset(); }
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  int release();
  void reset();
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// strerror(errno), for messages.
std::string errno_text();

void set_blocking(int fd, bool blocking);
// SO_SNDTIMEO and SO_RCVTIMEO; 0 waits forever.
void set_timeouts(int fd, std::chrono::milliseconds send, std::chrono::milliseconds recv);
void set_nodelay(int fd);

// Sends all bytes on a blocking socket (SO_SNDTIMEO bounds each wait).
// Returns empty on success, else why not.
std::string send_all(int fd, const char* data, size_t n);

// Reads exactly n bytes from a blocking socket, retrying interrupted calls, and
// calls `progress` after each piece that arrives. Returns n; or fewer when the
// peer closed (errno is then 0) or recv failed (errno says why, EAGAIN when
// SO_RCVTIMEO ran out).
size_t recv_exact(int fd, char* data, size_t n, const std::function<void()>& progress = {});

// "host:port" of the connected peer, or "an unknown peer".
std::string describe_peer(int fd);

// getaddrinfo's answer for a TCP `host` and `port`, freed on destruction.
using AddressList = std::unique_ptr<addrinfo, void (*)(addrinfo*)>;
// Returns getaddrinfo's status (0: resolved; else gai_strerror says why).
int resolve_tcp(const std::string& host, const std::string& port, AddressList* out);

}  // namespace hemiola::ps
