#include "ps/admission.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "hemiola/status.h"
#include "ps/protocol.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;

// More connections than this waiting to say hello are a flood: the oldest of
// them is closed to make room for each newcomer, so the server's descriptors
// stay bounded and silent connections cannot lock real workers out (a worker
// says hello as soon as it connects; a flood's connections wait to be evicted).
// A complete hello waiting for its token check is never evicted: when all of
// them are, newcomers wait in the kernel's queue (see kTokenChecksPerSecond).
constexpr size_t kMaxPending = 64;

// The first two entries of a poll round; pending connections follow.
constexpr size_t kListenerSlot = 0, kWakeSlot = 1, kFirstPendingSlot = 2;

// Compares without an early exit, so the time taken tells nothing about how
// much of the secret a guess got right.
bool same_token(const std::string& expected, const char* given, size_t n) {
  unsigned char diff = expected.size() == n ? 0 : 1;
  for (size_t i = 0; i < n; ++i)
    diff |= static_cast<unsigned char>(given[i]) ^
            static_cast<unsigned char>(i < expected.size() ? expected[i] : 0);
  return diff == 0;
}

Header error_header(const std::string& message) {
  Header h;
  h.type = static_cast<uint16_t>(MessageType::kError);
  h.aux = static_cast<int64_t>(ErrorCode::kAborted);
  h.payload_bytes = static_cast<int64_t>(message.size());
  h.checksum = header_checksum(h);
  return h;
}

Header welcome_header(int worker) {
  Header h;
  h.type = static_cast<uint16_t>(MessageType::kWelcome);
  h.worker = worker;
  h.checksum = header_checksum(h);
  return h;
}

// A listening socket on `address` (any port), or throws naming `server_name`.
Socket listen_on(const std::string& address, const std::string& server_name) {
  AddressList list(nullptr, nullptr);
  if (const int rc = resolve_tcp(address, "0", &list); rc != 0)
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, server_name, ": cannot resolve the bind address '",
                  address, "': ", ::gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s) continue;
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.fd(), 128) != 0) {
      why = errno_text();
      continue;
    }
    return s;
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, server_name, ": cannot listen on '", address, "': ",
                why, " (set GLOO_SOCKET_IFNAME or the iface option)");
}

// "host port" of a bound socket, numeric.
std::string bound_address(int fd) {
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  ::getnameinfo(reinterpret_cast<sockaddr*>(&bound), len, host, sizeof host, port, sizeof port,
                NI_NUMERICHOST | NI_NUMERICSERV);
  return detail::concat(host, " ", port);
}

}  // namespace

// ---- the budget of token checks ------------------------------------------------

void CheckBudget::refill(Clock::time_point now) {
  if (started_ && now > last_)
    units_ = std::min(burst_, units_ + std::chrono::duration<double>(now - last_).count() *
                                          per_second_);
  if (!started_ || now > last_) last_ = now;
  started_ = true;
}

bool CheckBudget::take(Clock::time_point now) {
  refill(now);
  if (units_ < 1) return false;
  units_ -= 1;
  return true;
}

std::chrono::milliseconds CheckBudget::until_next(Clock::time_point now) {
  refill(now);
  if (units_ >= 1) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(static_cast<int64_t>((1 - units_) / per_second_ * 1000) + 1);
}

// A connection that has not yet said hello.
struct Acceptor::Pending {
  Socket socket;
  std::string from;
  Clock::time_point since;
  std::vector<char> bytes;  // the hello so far
  bool complete = false;    // the whole hello arrived: it waits for its token check
  bool done = false;        // admitted or refused: remove

  bool has_header() const { return bytes.size() >= sizeof(Header); }
  // Only once has_header().
  Header header() const {
    Header h;
    std::memcpy(&h, bytes.data(), sizeof(Header));
    return h;
  }
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
  listener_ = listen_on(address, server_name_);
  set_blocking(listener_.fd(), false);
  address_ = bound_address(listener_.fd());
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

// ---- one poll round -------------------------------------------------------------

void Acceptor::poll_once(std::chrono::milliseconds wait, bool admitting,
                         std::vector<Socket>& admitted) {
  const std::vector<pollfd> fds = wait_for_activity(wait);
  // Hellos first (fds matches pending_ as it was before this round).
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = *pending_[i];
    if (fds[kFirstPendingSlot + i].revents != 0 && read_hello(p)) p.complete = true;
  }
  check_waiting(admitting, admitted);
  drop_silent();
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [](const auto& p) { return p->done; }),
                 pending_.end());
  // Then newcomers.
  if (fds[kListenerSlot].revents & POLLIN) accept_newcomers();
}

std::vector<pollfd> Acceptor::wait_for_activity(std::chrono::milliseconds wait) {
  // No longer than until the first pending connection's hello is overdue, or
  // (when complete hellos wait) the budget allows the next token check.
  const auto now = Clock::now();
  bool waiting = false, evictable = false;
  for (const auto& p : pending_) {
    if (p->complete) {
      waiting = true;
      continue;
    }
    evictable = true;
    wait = std::min(wait, std::chrono::duration_cast<std::chrono::milliseconds>(
                              p->since + hello_timeout_ - now) + std::chrono::milliseconds(1));
  }
  if (waiting) wait = std::min(wait, budget_.until_next(now));
  // A negative descriptor is not polled: newcomers are not taken while every
  // slot holds a hello waiting for its check (they wait in the kernel's
  // queue), nor is a complete hello read further.
  const bool room = pending_.size() < kMaxPending || evictable;
  std::vector<pollfd> fds = {{room ? listener_.fd() : -1, POLLIN, 0}, {wake_[0], POLLIN, 0}};
  for (const auto& p : pending_) fds.push_back({p->complete ? -1 : p->socket.fd(), POLLIN, 0});
  const int ready = ::poll(fds.data(), fds.size(),
                           static_cast<int>(std::max<int64_t>(0, wait.count())));
  if (ready < 0 && errno != EINTR) HEMIOLA_THROW(ErrorCode::kCommFailure, "poll: ", errno_text());
  if (ready <= 0) {
    for (auto& f : fds) f.revents = 0;
    return fds;
  }
  if (fds[kWakeSlot].revents & POLLIN) {  // stop() was called: empty the pipe
    char sink[16];
    while (::read(wake_[0], sink, sizeof sink) > 0) {
    }
  }
  return fds;
}

bool Acceptor::read_hello(Pending& p) {
  // Read no further than the hello: what follows it is the channel's.
  size_t want = sizeof(Header);
  if (p.has_header()) want += static_cast<size_t>(p.header().payload_bytes);
  const size_t at = p.bytes.size();
  p.bytes.resize(want);
  const ssize_t r = ::recv(p.socket.fd(), p.bytes.data() + at, want - at, 0);
  if (r <= 0) {
    p.bytes.resize(at);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    refuse(p, detail::concat("it closed the connection after ", at, " bytes, before its hello "
                             "was complete"), false);
    return false;
  }
  p.bytes.resize(at + static_cast<size_t>(r));
  if (!p.has_header()) return false;
  const Header h = p.header();
  if (p.bytes.size() == sizeof(Header)) {  // just completed: check before reading more
    if (auto problem = header_problem(h); !problem.empty()) {
      refuse(p, detail::concat("not a hemiola hello: ", problem), true);
      return false;
    }
    if (h.type != static_cast<uint16_t>(MessageType::kHello) || h.seq != 0) {
      refuse(p, detail::concat("it began with a ", message_type_name(h.type), " message, not a "
                               "hello"), true);
      return false;
    }
    if (h.payload_bytes > kMaxHelloBytes) {
      refuse(p, detail::concat("an oversized hello (", h.payload_bytes, " bytes)"), true);
      return false;
    }
  }
  return p.bytes.size() >= sizeof(Header) + static_cast<size_t>(h.payload_bytes);
}

void Acceptor::check_waiting(bool admitting, std::vector<Socket>& admitted) {
  for (auto& p : pending_) {
    if (!p->complete || p->done) continue;
    if (!budget_.take(Clock::now())) return;  // the rest wait their turn
    if (admit_or_refuse(*p, admitting, admitted)) budget_.give_back();
  }
}

bool Acceptor::admit_or_refuse(Pending& p, bool admitting, std::vector<Socket>& admitted) {
  const Header h = p.header();
  const char* token = p.bytes.data() + sizeof(Header);
  const auto token_bytes = static_cast<size_t>(h.payload_bytes);
  if (!same_token(token_, token, token_bytes)) {
    refuse(p, token_.empty() ? "it presented a job token, but this server runs without one "
                               "(set HEMIOLA_JOB_TOKEN for the servers too)"
              : token_bytes == 0 ? "no job token presented (this job requires "
                                   "HEMIOLA_JOB_TOKEN)"
                                 : "wrong job token (HEMIOLA_JOB_TOKEN differs from the "
                                   "server's)",
           true);
    return false;
  }
  if (h.worker < 0 || h.worker >= num_workers_) {
    refuse(p, detail::concat("worker index ", h.worker, " is outside [0, ", num_workers_, ")"),
           true);
    return false;
  }
  if (!admitting || admitted[static_cast<size_t>(h.worker)]) {
    refuse(p, detail::concat("worker ", h.worker, " is already connected (a worker cannot join "
                             "or rejoin a running parameter server)"),
           true);
    return false;
  }
  const Header welcome = welcome_header(h.worker);
  set_blocking(p.socket.fd(), true);
  set_timeouts(p.socket.fd(), hello_timeout_, std::chrono::milliseconds(0));
  if (const auto failed = send_all(p.socket.fd(), reinterpret_cast<const char*>(&welcome),
                                   sizeof welcome);
      !failed.empty()) {
    refuse(p, detail::concat("it vanished during the handshake: ", failed), false);
    return false;
  }
  admitted[static_cast<size_t>(h.worker)] = std::move(p.socket);
  p.done = true;
  return true;
}

// Silent ones: dropped hello_timeout after they connected.
void Acceptor::drop_silent() {
  for (auto& p : pending_) {
    if (p->done || p->complete || Clock::now() - p->since < hello_timeout_) continue;
    refuse(*p, p->bytes.empty()
                   ? detail::concat("it said nothing for ", hello_timeout_.count() / 1000.0, " s")
                   : detail::concat("its hello was incomplete (", p->bytes.size(), " bytes) after ",
                                    hello_timeout_.count() / 1000.0, " s"),
           true);
  }
}

void Acceptor::accept_newcomers() {
  const auto round = Clock::now();
  for (;;) {
    // When full, the one waiting longest to say hello makes room: pending_ is
    // in arrival order. Not a complete hello (it waits for its token check),
    // nor one accepted in this round (it has not had the chance to speak);
    // with none to close, newcomers wait in the kernel's queue.
    auto evict = pending_.end();
    if (pending_.size() >= kMaxPending) {
      evict = std::find_if(pending_.begin(), pending_.end(),
                           [&](const auto& p) { return !p->complete && p->since < round; });
      if (evict == pending_.end()) break;
    }
    Socket s(::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!s) break;
    auto p = std::make_unique<Pending>();
    p->from = describe_peer(s.fd());
    p->socket = std::move(s);
    p->since = Clock::now();
    if (evict != pending_.end()) {
      refuse(**evict,
             detail::concat(kMaxPending, " connections were waiting to say hello; the one "
                            "waiting longest is closed to make room"),
             false);
      pending_.erase(evict);
    }
    pending_.push_back(std::move(p));
  }
}

// ---- the two phases ---------------------------------------------------------------

std::vector<Socket> Acceptor::admit_all(Clock::time_point deadline) {
  std::vector<Socket> admitted(static_cast<size_t>(num_workers_));
  const auto all_admitted = [&] {
    return std::all_of(admitted.begin(), admitted.end(), [](const Socket& s) { return bool(s); });
  };
  while (!all_admitted()) {
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
              admitted);
  }
  return admitted;
}

void Acceptor::refuse_until_stopped() {
  std::vector<Socket> none(static_cast<size_t>(num_workers_));
  while (!stopped_) poll_once(std::chrono::milliseconds(1000), false, none);
  for (auto& p : pending_) p->socket.reset();
  pending_.clear();
}

}  // namespace hemiola::ps
