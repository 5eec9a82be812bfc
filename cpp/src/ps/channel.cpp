#include "ps/channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "comm/network.h"
#include "hemiola/status.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;

// More connections than this waiting to say hello are a flood: the oldest of
// them is closed to make room for each newcomer, so the server's descriptors
// stay bounded and silent connections cannot lock real workers out (a worker
// says hello as soon as it connects; a flood's connections wait to be evicted).
constexpr size_t kMaxPending = 64;
// Payloads are read in pieces of at most this size, so a header that merely
// claims a huge payload costs no memory until the bytes actually arrive.
constexpr size_t kReadChunk = size_t(1) << 20;

std::string errno_text() { return std::strerror(errno); }

timeval as_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

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

// Sends all bytes on a blocking socket (SO_SNDTIMEO bounds each wait).
// Returns empty on success, else why not.
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

std::vector<char> frame(const Header& h, const std::vector<char>& payload) {
  std::vector<char> bytes(sizeof(Header) + payload.size());
  std::memcpy(bytes.data(), &h, sizeof(Header));
  if (!payload.empty()) std::memcpy(bytes.data() + sizeof(Header), payload.data(), payload.size());
  return bytes;
}

Header error_header(const std::string& message) {
  Header h;
  h.type = static_cast<uint16_t>(MessageType::kError);
  h.aux = static_cast<int64_t>(ErrorCode::kAborted);
  h.payload_bytes = static_cast<int64_t>(message.size());
  h.checksum = header_checksum(h);
  return h;
}

// Compares without an early exit, so the time taken tells nothing about how
// much of the secret a guess got right.
bool same_token(const std::string& expected, const char* given, size_t n) {
  unsigned char diff = expected.size() == n ? 0 : 1;
  for (size_t i = 0; i < n; ++i)
    diff |= static_cast<unsigned char>(given[i]) ^
            static_cast<unsigned char>(i < expected.size() ? expected[i] : 0);
  return diff == 0;
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

std::string address_of_interface(const std::string& iface) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string v4, v6;
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || iface != ifa->ifa_name) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (ifa->ifa_addr->sa_family == AF_INET && v4.empty()) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(ifa->ifa_addr)->sin_addr, buf, sizeof buf);
      v4 = buf;
    } else if (ifa->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      const auto* a = &reinterpret_cast<sockaddr_in6*>(ifa->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LINKLOCAL(a)) continue;  // needs a scope id; not worth it
      ::inet_ntop(AF_INET6, a, buf, sizeof buf);
      v6 = buf;
    }
  }
  ::freeifaddrs(list);
  return v4.empty() ? v6 : v4;
}

}  // namespace

// ---- addresses -----------------------------------------------------------------

std::string bind_address(const BindSpec& spec) {
  if (!spec.iface.empty()) {
    const std::string address = address_of_interface(spec.iface);
    HEMIOLA_CHECK(!address.empty(), "network interface '", spec.iface,
                  "' has no usable IP address (check GLOO_SOCKET_IFNAME or the iface option)");
    return address;
  }
  if (!spec.hostname.empty()) return spec.hostname;
  if (std::string a = local_address_reaching(spec.master_addr); !a.empty()) return a;
  if (spec.alone) return "127.0.0.1";
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "127.0.0.1";
  return name;
}

std::string address_key(int server_index) { return detail::concat("ps/s", server_index, "/address"); }

namespace {
constexpr char kStartupFailed[] = "failed to start: ";
}  // namespace

std::string startup_failure(const std::string& why) { return kStartupFailed + why; }

Header hello_header(int worker, const std::string& token) {
  Header h;
  h.type = static_cast<uint16_t>(MessageType::kHello);
  h.worker = worker;
  h.payload_bytes = static_cast<int64_t>(token.size());
  h.checksum = header_checksum(h);
  return h;
}

// ---- Socket --------------------------------------------------------------------

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

// ---- Channel -------------------------------------------------------------------

Channel::Channel(Socket socket, std::string peer, std::chrono::milliseconds send_timeout,
                 std::chrono::milliseconds heartbeat)
    : peer_(std::move(peer)), heartbeat_(heartbeat), socket_(std::move(socket)) {
  HEMIOLA_CHECK(socket_, "a channel needs a connected socket");
  set_blocking(socket_.fd(), true);
  // Receives wait as long as a worker computes (a straggler may be slow);
  // liveness comes from the heartbeats and the owner's watchdog instead.
  set_timeouts(socket_.fd(), send_timeout, std::chrono::milliseconds(0));
  set_nodelay(socket_.fd());
  last_heard_ = Clock::now();
  sender_ = std::thread([this] { sender_loop(); });
}

Channel::~Channel() {
  close();
  if (sender_.joinable()) sender_.join();
}

bool Channel::send(Header header, std::vector<char> payload) {
  header.payload_bytes = static_cast<int64_t>(payload.size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || !send_failure_.empty()) return false;
    header.seq = next_seq_++;
    header.checksum = header_checksum(header);
    queue_.push_back(Outgoing{frame(header, payload)});
  }
  changed_.notify_all();
  return true;
}

bool Channel::send_raw(std::vector<char> bytes) { return enqueue(std::move(bytes)); }

bool Channel::send_raw(const Header& header, const std::vector<char>& payload) {
  return enqueue(frame(header, payload));
}

bool Channel::enqueue(std::vector<char> bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || !send_failure_.empty()) return false;
    queue_.push_back(Outgoing{std::move(bytes)});
  }
  changed_.notify_all();
  return true;
}

void Channel::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait_for(lock, timeout, [&] {
    return (queue_.empty() && !sending_) || !send_failure_.empty();
  });
}

std::chrono::steady_clock::duration Channel::silent_for() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return Clock::now() - last_heard_;
}

std::string Channel::send_failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return send_failure_;
}

void Channel::sender_loop() {
  for (;;) {
    Outgoing message;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      const auto ready = [&] { return !queue_.empty() || closing_; };
      if (heartbeat_.count() > 0) {
        changed_.wait_for(lock, heartbeat_, ready);
      } else {
        changed_.wait(lock, ready);
      }
      if (queue_.empty() && closing_) return;  // closing and drained
      if (queue_.empty()) {  // idle for a heartbeat: say we are here
        Header ping;
        ping.type = static_cast<uint16_t>(MessageType::kPing);
        ping.checksum = header_checksum(ping);
        message.bytes = frame(ping, {});
      } else {
        message = std::move(queue_.front());
        queue_.pop_front();
      }
      sending_ = true;
    }
    std::string failure = send_all(socket_.fd(), message.bytes.data(), message.bytes.size());
    if (!failure.empty()) failure = detail::concat("sending to ", peer_, " failed: ", failure);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sending_ = false;
      if (!failure.empty()) {
        send_failure_ = failure;
        queue_.clear();
      }
    }
    changed_.notify_all();
    if (!failure.empty()) return;
  }
}

bool Channel::receive(Header* header, std::vector<char>* payload) {
  // Reads exactly n bytes; false when close() aborted the wait.
  auto read_exact = [&](char* data, size_t n, const char* what) {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::recv(socket_.fd(), data + got, n - got, 0);
      if (r > 0) {
        got += static_cast<size_t>(r);
        std::lock_guard<std::mutex> lock(mutex_);
        last_heard_ = Clock::now();
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (closed_) return false;
      if (r == 0 && got == 0 && std::strcmp(what, "header") == 0)
        HEMIOLA_THROW(ErrorCode::kCommFailure, "connection to ", peer_, " closed");
      if (r == 0)
        HEMIOLA_THROW(ErrorCode::kCommFailure, "connection to ", peer_,
                      " closed in the middle of a message (a truncated ", what, ": ", got, " of ",
                      n, " bytes)");
      HEMIOLA_THROW(ErrorCode::kCommFailure, "connection to ", peer_, " lost: ", errno_text());
    }
    return true;
  };
  do {
    if (!read_exact(reinterpret_cast<char*>(header), sizeof(Header), "header")) return false;
    // A header that is not ours, or garbled, leaves the stream's framing
    // unknown: nothing after it can be trusted, so the connection goes.
    if (const auto problem = header_problem(*header); !problem.empty())
      HEMIOLA_THROW(ErrorCode::kCommFailure, "protocol violation from ", peer_, ": ", problem,
                    "; dropping the connection");
  } while (header->type == static_cast<uint16_t>(MessageType::kPing) &&
           header->payload_bytes == 0);  // a ping carries no sequence number for the owner
  payload->clear();
  const auto total = static_cast<size_t>(header->payload_bytes);
  while (payload->size() < total) {
    const size_t at = payload->size();
    payload->resize(at + std::min(kReadChunk, total - at));
    if (!read_exact(payload->data() + at, payload->size() - at, "payload")) return false;
  }
  return true;
}

void Channel::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closing_ = true;
  }
  changed_.notify_all();
  if (sender_.joinable() && std::this_thread::get_id() != sender_.get_id()) sender_.join();
  closed_ = true;
  // Wakes a receive blocked in recv() (it then sees closed_ and returns false).
  if (socket_) ::shutdown(socket_.fd(), SHUT_RDWR);
}

void Channel::disconnect() {
  close();
  socket_.reset();
}

// ---- Acceptor -------------------------------------------------------------------

struct Acceptor::Pending {
  Socket socket;
  std::string from;
  Clock::time_point since;
  std::vector<char> bytes;  // the hello so far
  bool done = false;        // admitted or refused: remove
};

Acceptor::Acceptor(const std::string& address, std::string token, int num_workers,
                   std::chrono::milliseconds hello_timeout, std::string server_name,
                   RefusalHandler on_refused)
    : token_(std::move(token)),
      num_workers_(num_workers),
      hello_timeout_(hello_timeout),
      server_name_(std::move(server_name)),
      on_refused_(std::move(on_refused)) {
  HEMIOLA_CHECK(token_.size() <= static_cast<size_t>(kMaxHelloBytes), "the job token is longer "
                "than ", kMaxHelloBytes, " bytes");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (const int rc = ::getaddrinfo(address.c_str(), "0", &hints, &result); rc != 0)
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, server_name_, ": cannot resolve the bind address '",
                  address, "': ", ::gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* ai = result; ai != nullptr && !listener_; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s) continue;
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.fd(), 128) != 0) {
      why = errno_text();
      continue;
    }
    listener_ = std::move(s);
  }
  ::freeaddrinfo(result);
  if (!listener_)
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, server_name_, ": cannot listen on '", address,
                  "': ", why, " (set GLOO_SOCKET_IFNAME or the iface option)");
  set_blocking(listener_.fd(), false);
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(listener_.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  ::getnameinfo(reinterpret_cast<sockaddr*>(&bound), len, host, sizeof host, port, sizeof port,
                NI_NUMERICHOST | NI_NUMERICSERV);
  address_ = detail::concat(host, " ", port);
  HEMIOLA_CHECK(::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0, "pipe: ", errno_text());
}

Acceptor::~Acceptor() {
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void Acceptor::stop() {
  stopped_ = true;
  const char byte = 1;
  [[maybe_unused]] const auto n = ::write(wake_[1], &byte, 1);
}

void Acceptor::refuse(Pending& p, const std::string& why, bool tell) {
  if (tell) {  // best effort: the socket is non-blocking and the message small
    const std::string message = detail::concat(server_name_, " refused the connection: ", why);
    const auto bytes = frame(error_header(message), std::vector<char>(message.begin(), message.end()));
    [[maybe_unused]] const auto n = ::send(p.socket.fd(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }
  p.socket.reset();
  p.done = true;
  if (on_refused_) on_refused_(detail::concat("refused a connection from ", p.from, ": ", why));
}

void Acceptor::poll_once(std::chrono::milliseconds wait, bool admitting,
                         std::vector<Socket>& admitted, int& count) {
  const auto now = Clock::now();
  for (const auto& p : pending_)
    wait = std::min(wait, std::chrono::duration_cast<std::chrono::milliseconds>(
                              p->since + hello_timeout_ - now) + std::chrono::milliseconds(1));
  std::vector<pollfd> fds = {{listener_.fd(), POLLIN, 0}, {wake_[0], POLLIN, 0}};
  for (const auto& p : pending_) fds.push_back({p->socket.fd(), POLLIN, 0});
  const int ready = ::poll(fds.data(), fds.size(),
                           static_cast<int>(std::max<int64_t>(0, wait.count())));
  if (ready < 0 && errno != EINTR) HEMIOLA_THROW(ErrorCode::kCommFailure, "poll: ", errno_text());
  if (ready > 0 && (fds[1].revents & POLLIN)) {
    char sink[16];
    while (::read(wake_[0], sink, sizeof sink) > 0) {
    }
  }
  // Hellos first (the descriptors in fds match pending_ as it was).
  for (size_t i = 0; ready > 0 && i < pending_.size(); ++i) {
    Pending& p = *pending_[i];
    if (fds[i + 2].revents == 0) continue;
    const size_t header_bytes = sizeof(Header);
    size_t want = header_bytes;
    if (p.bytes.size() >= header_bytes) {
      Header h;
      std::memcpy(&h, p.bytes.data(), header_bytes);
      want += static_cast<size_t>(h.payload_bytes);
    }
    const size_t at = p.bytes.size();
    p.bytes.resize(want);
    const ssize_t r = ::recv(p.socket.fd(), p.bytes.data() + at, want - at, 0);
    if (r <= 0) {
      p.bytes.resize(at);
      if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      refuse(p, detail::concat("it closed the connection after ", at, " bytes, before its hello "
                               "was complete"), false);
      continue;
    }
    p.bytes.resize(at + static_cast<size_t>(r));
    if (p.bytes.size() < header_bytes) continue;
    Header h;
    std::memcpy(&h, p.bytes.data(), header_bytes);
    if (p.bytes.size() == header_bytes) {  // just completed: check before reading more
      if (auto problem = header_problem(h); !problem.empty()) {
        refuse(p, detail::concat("not a hemiola hello: ", problem), true);
        continue;
      }
      if (h.type != static_cast<uint16_t>(MessageType::kHello) || h.seq != 0) {
        refuse(p, detail::concat("it began with a ", message_type_name(h.type), " message, not a "
                                 "hello"), true);
        continue;
      }
      if (h.payload_bytes > kMaxHelloBytes) {
        refuse(p, detail::concat("an oversized hello (", h.payload_bytes, " bytes)"), true);
        continue;
      }
    }
    if (p.bytes.size() < header_bytes + static_cast<size_t>(h.payload_bytes)) continue;
    // A complete hello.
    const char* token = p.bytes.data() + header_bytes;
    const auto token_bytes = static_cast<size_t>(h.payload_bytes);
    if (!same_token(token_, token, token_bytes)) {
      refuse(p, token_.empty() ? "it presented a job token, but this server runs without one "
                                 "(set HEMIOLA_JOB_TOKEN for the servers too)"
                : token_bytes == 0 ? "no job token presented (this job requires "
                                     "HEMIOLA_JOB_TOKEN)"
                                   : "wrong job token (HEMIOLA_JOB_TOKEN differs from the "
                                     "server's)",
             true);
      continue;
    }
    if (h.worker < 0 || h.worker >= num_workers_) {
      refuse(p, detail::concat("worker index ", h.worker, " is outside [0, ", num_workers_, ")"),
             true);
      continue;
    }
    if (!admitting || admitted[static_cast<size_t>(h.worker)]) {
      refuse(p, detail::concat("worker ", h.worker, " is already connected (a worker cannot join "
                               "or rejoin a running parameter server)"),
             true);
      continue;
    }
    Header welcome;
    welcome.type = static_cast<uint16_t>(MessageType::kWelcome);
    welcome.worker = h.worker;
    welcome.checksum = header_checksum(welcome);
    set_blocking(p.socket.fd(), true);
    set_timeouts(p.socket.fd(), hello_timeout_, std::chrono::milliseconds(0));
    if (const auto failed = send_all(p.socket.fd(), reinterpret_cast<const char*>(&welcome),
                                     sizeof welcome);
        !failed.empty()) {
      refuse(p, detail::concat("it vanished during the handshake: ", failed), false);
      continue;
    }
    admitted[static_cast<size_t>(h.worker)] = std::move(p.socket);
    p.done = true;
    count += 1;
  }
  // Silent ones: dropped hello_timeout after they connected.
  for (auto& p : pending_) {
    if (p->done || Clock::now() - p->since < hello_timeout_) continue;
    refuse(*p, p->bytes.empty()
                   ? detail::concat("it said nothing for ", hello_timeout_.count() / 1000.0, " s")
                   : detail::concat("its hello was incomplete (", p->bytes.size(), " bytes) after ",
                                    hello_timeout_.count() / 1000.0, " s"),
           true);
  }
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [](const auto& p) { return p->done; }),
                 pending_.end());
  // Then newcomers.
  if (ready > 0 && (fds[0].revents & POLLIN)) {
    for (;;) {
      Socket s(::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!s) break;
      auto p = std::make_unique<Pending>();
      p->from = describe_peer(s.fd());
      p->socket = std::move(s);
      p->since = Clock::now();
      if (pending_.size() >= kMaxPending) {
        // pending_ is in arrival order: the front waited longest.
        refuse(*pending_.front(),
               detail::concat(kMaxPending, " connections were waiting to say hello; the one "
                              "waiting longest is closed to make room"),
               false);
        pending_.erase(pending_.begin());
      }
      pending_.push_back(std::move(p));
    }
  }
}

std::vector<Socket> Acceptor::admit_all(Clock::time_point deadline) {
  std::vector<Socket> admitted(static_cast<size_t>(num_workers_));
  int count = 0;
  while (count < num_workers_) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::string missing;
      for (int w = 0; w < num_workers_; ++w)
        if (!admitted[static_cast<size_t>(w)])
          missing += detail::concat(missing.empty() ? "" : ", ", w);
      HEMIOLA_THROW(ErrorCode::kTimeout, server_name_, ": worker(s) ", missing,
                    " did not connect in time (started, same job token, same MASTER_ADDR?)");
    }
    poll_once(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now), true,
              admitted, count);
  }
  return admitted;
}

void Acceptor::refuse_until_stopped() {
  std::vector<Socket> none(static_cast<size_t>(num_workers_));
  int count = 0;
  while (!stopped_) poll_once(std::chrono::milliseconds(1000), false, none, count);
  for (auto& p : pending_) p->socket.reset();
  pending_.clear();
}

// ---- the worker's side ------------------------------------------------------------

Socket connect_to_server(Store& store, int server_index, int worker, const std::string& token,
                         std::chrono::milliseconds timeout, const std::string& server_name) {
  const auto deadline = Clock::now() + timeout;
  const std::string published = store.get(address_key(server_index), timeout);
  if (published.rfind(kStartupFailed, 0) == 0) {  // "failed to start: why"
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, server_name, " ", published,
                  " (this worker cannot train without it)");
  }
  const auto space = published.rfind(' ');
  HEMIOLA_CHECK(space != std::string::npos, "the store holds no valid address for ", server_name,
                ": '", published, "'");
  const std::string host = published.substr(0, space), port = published.substr(space + 1);
  auto remaining = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  // Why the last try failed, for the error after the deadline.
  std::string why = "no address";
  // One connection, or none (`why` says why not).
  auto connect_once = [&]() -> Socket {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* result = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &result); rc != 0) {
      why = ::gai_strerror(rc);
      return Socket();
    }
    Socket s;
    for (addrinfo* ai = result; ai != nullptr && !s; ai = ai->ai_next) {
      Socket c(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!c) continue;
      if (::connect(c.fd(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
        why = errno_text();
        continue;
      }
      pollfd pfd{c.fd(), POLLOUT, 0};
      int error = 0;
      socklen_t len = sizeof error;
      if (::poll(&pfd, 1, static_cast<int>(remaining().count())) == 1 &&
          ::getsockopt(c.fd(), SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0) {
        s = std::move(c);
      } else {
        why = error ? std::strerror(error) : "timed out";
      }
    }
    ::freeaddrinfo(result);
    return s;
  };
  // The hello on connection `s`: true when welcomed; false when the server
  // closed the connection without an answer (it was full of connections
  // waiting to say hello, or restarting its accept loop), which is worth
  // another try; throws on an answer that refuses.
  auto hello = [&](const Socket& s) -> bool {
    set_blocking(s.fd(), true);
    set_timeouts(s.fd(), remaining(), remaining());
    const Header header = hello_header(worker, token);
    std::string failed = send_all(s.fd(), reinterpret_cast<const char*>(&header), sizeof header);
    if (failed.empty()) failed = send_all(s.fd(), token.data(), token.size());
    if (!failed.empty()) {
      why = "sending its hello failed: " + failed;
      return false;
    }
    // The answer: a welcome, or an error saying why not. `answered`: some of
    // it arrived (a closed connection after that is no eviction).
    bool answered = false;
    auto read_exact = [&](char* data, size_t n) {
      size_t got = 0;
      while (got < n) {
        const ssize_t r = ::recv(s.fd(), data + got, n - got, 0);
        if (r > 0) {
          got += static_cast<size_t>(r);
          answered = true;
        } else if (r < 0 && errno == EINTR) {
          continue;
        } else if (r < 0 && errno == EAGAIN) {
          HEMIOLA_THROW(ErrorCode::kTimeout, "worker ", worker, ": ", server_name,
                        " did not answer its hello within ", timeout.count() / 1000.0, " s");
        } else {
          why = detail::concat("it did not answer the hello: ",
                               r == 0 ? "the connection closed" : errno_text());
          return false;
        }
      }
      return true;
    };
    Header reply;
    if (!read_exact(reinterpret_cast<char*>(&reply), sizeof reply)) {
      HEMIOLA_CHECK(!answered, "worker ", worker, ": ", server_name, " ", why);
      return false;
    }
    const std::string problem = header_problem(reply);
    HEMIOLA_CHECK(problem.empty(), "worker ", worker, ": ", server_name,
                  " answered its hello with a malformed message: ", problem);
    if (reply.type == static_cast<uint16_t>(MessageType::kError)) {
      std::string message(static_cast<size_t>(std::min<int64_t>(reply.payload_bytes, 1 << 16)),
                          '\0');
      HEMIOLA_CHECK(read_exact(message.data(), message.size()), "worker ", worker, ": ",
                    server_name, " ", why);
      HEMIOLA_THROW(ErrorCode::kAborted, "worker ", worker, ": ", message);
    }
    HEMIOLA_CHECK(reply.type == static_cast<uint16_t>(MessageType::kWelcome),
                  "worker ", worker, ": ", server_name, " answered its hello with a ",
                  message_type_name(reply.type));
    return true;
  };
  // Until the deadline: connect, then say hello. A last try that could not
  // connect is a timeout; one that connected but was not admitted says so.
  for (;;) {
    Socket s = connect_once();
    if (s && hello(s)) return s;
    if (Clock::now() >= deadline) {
      if (!s)
        HEMIOLA_THROW(ErrorCode::kTimeout, "worker ", worker, ": cannot connect to ",
                      server_name, " at ", host, " port ", port, " within ",
                      timeout.count() / 1000.0, " s: ", why);
      HEMIOLA_THROW(ErrorCode::kCommFailure, "worker ", worker, ": ", server_name, " at ", host,
                    " port ", port, " admitted it in none of its tries within ",
                    timeout.count() / 1000.0, " s; the last: ", why);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace hemiola::ps
