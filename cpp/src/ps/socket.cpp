#include "ps/socket.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "hemiola/status.h"

namespace hemiola::ps {

namespace {

timeval as_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

}  // namespace

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int Socket::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string errno_text() { return std::strerror(errno); }

void set_blocking(int fd, bool blocking) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, blocking ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK));
}

void set_timeouts(int fd, std::chrono::milliseconds send, std::chrono::milliseconds recv) {
  const timeval s = as_timeval(send), r = as_timeval(recv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &s, sizeof s);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &r, sizeof r);
}

void set_nodelay(int fd) {
  int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

std::string send_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t sent = ::send(fd, data, n, MSG_NOSIGNAL);
    if (sent > 0) {
      data += sent;
      n -= static_cast<size_t>(sent);
    } else if (sent < 0 && errno == EINTR) {
      continue;
    } else if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return "the peer stopped reading (send timed out)";
    } else {
      return errno_text();
    }
  }
  return {};
}

size_t recv_exact(int fd, char* data, size_t n, const std::function<void()>& progress) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, data + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
      if (progress) progress();
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      if (r == 0) errno = 0;
      return got;
    }
  }
  return got;
}

std::string describe_peer(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "an unknown peer";
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "an unknown peer";
  return detail::concat(host, ":", port);
}

int resolve_tcp(const std::string& host, const std::string& port, AddressList* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
  *out = AddressList(rc == 0 ? result : nullptr, [](addrinfo* a) {
    if (a != nullptr) ::freeaddrinfo(a);
  });
  return rc;
}

}  // namespace hemiola::ps
