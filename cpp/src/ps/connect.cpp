#include "ps/connect.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "hemiola/status.h"
#include "ps/address.h"
#include "ps/protocol.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;

// A worker's tries to connect to one server and be admitted before a
// deadline. `why_` keeps why the last try failed, for the error after the
// deadline.
class Dialer {
 public:
  Dialer(ServerAddress address, int worker, const std::string& token,
         std::chrono::milliseconds timeout, Clock::time_point deadline,
         const std::string& server_name)
      : address_(std::move(address)),
        worker_(worker),
        token_(token),
        timeout_(timeout),
        deadline_(deadline),
        server_name_(server_name) {}

  // One connection, or none (why_ says why not).
  Socket connect_once();
  // The hello on connection `s`: true when welcomed; false when the server
  // closed the connection without an answer (it was full of connections
  // waiting to say hello, or restarting its accept loop), which is worth
  // another try; throws on an answer that refuses.
  bool hello(const Socket& s);
  // After the deadline: a last try that could not connect is a timeout; one
  // that connected but was not admitted says so.
  [[noreturn]] void give_up(bool connected) const;

 private:
  std::chrono::milliseconds remaining() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()));
  }
  // Reads the server's answer; false (why_ set) when the connection closed or
  // failed first. `answered`: some of the answer arrived.
  bool read_answer(const Socket& s, char* data, size_t n, bool* answered);

  const ServerAddress address_;
  const int worker_;
  const std::string& token_;
  const std::chrono::milliseconds timeout_;
  const Clock::time_point deadline_;
  const std::string& server_name_;
  std::string why_ = "no address";
};

Socket Dialer::connect_once() {
  AddressList list(nullptr, nullptr);
  if (const int rc = resolve_tcp(address_.host, address_.port, &list); rc != 0) {
    why_ = ::gai_strerror(rc);
    return Socket();
  }
  for (addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    Socket c(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!c) continue;
    if (::connect(c.fd(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      why_ = errno_text();
      continue;
    }
    pollfd pfd{c.fd(), POLLOUT, 0};
    int error = 0;
    socklen_t len = sizeof error;
    if (::poll(&pfd, 1, static_cast<int>(remaining().count())) == 1 &&
        ::getsockopt(c.fd(), SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0)
      return c;
    why_ = error ? std::strerror(error) : "timed out";
  }
  return Socket();
}

bool Dialer::read_answer(const Socket& s, char* data, size_t n, bool* answered) {
  const size_t got = recv_exact(s.fd(), data, n);
  if (got > 0) *answered = true;
  if (got == n) return true;
  if (errno == EAGAIN)
    HEMIOLA_THROW(ErrorCode::kTimeout, "worker ", worker_, ": ", server_name_,
                  " did not answer its hello within ", timeout_.count() / 1000.0, " s");
  why_ = detail::concat("it did not answer the hello: ",
                        errno == 0 ? "the connection closed" : errno_text());
  return false;
}

bool Dialer::hello(const Socket& s) {
  set_blocking(s.fd(), true);
  set_timeouts(s.fd(), remaining(), remaining());
  const Header header = hello_header(worker_, token_);
  std::string failed = send_all(s.fd(), reinterpret_cast<const char*>(&header), sizeof header);
  if (failed.empty()) failed = send_all(s.fd(), token_.data(), token_.size());
  if (!failed.empty()) {
    why_ = "sending its hello failed: " + failed;
    return false;
  }
  // The answer: a welcome, or an error saying why not. A closed connection
  // after some of it arrived is no eviction.
  bool answered = false;
  Header reply;
  if (!read_answer(s, reinterpret_cast<char*>(&reply), sizeof reply, &answered)) {
    HEMIOLA_CHECK(!answered, "worker ", worker_, ": ", server_name_, " ", why_);
    return false;
  }
  const std::string problem = header_problem(reply);
  HEMIOLA_CHECK(problem.empty(), "worker ", worker_, ": ", server_name_,
                " answered its hello with a malformed message: ", problem);
  if (reply.type == static_cast<uint16_t>(MessageType::kError)) {
    std::string message(static_cast<size_t>(std::min<int64_t>(reply.payload_bytes, 1 << 16)),
                        '\0');
    HEMIOLA_CHECK(read_answer(s, message.data(), message.size(), &answered), "worker ", worker_,
                  ": ", server_name_, " ", why_);
    HEMIOLA_THROW(ErrorCode::kAborted, "worker ", worker_, ": ", message);
  }
  HEMIOLA_CHECK(reply.type == static_cast<uint16_t>(MessageType::kWelcome), "worker ", worker_,
                ": ", server_name_, " answered its hello with a ", message_type_name(reply.type));
  return true;
}

void Dialer::give_up(bool connected) const {
  if (!connected)
    HEMIOLA_THROW(ErrorCode::kTimeout, "worker ", worker_, ": cannot connect to ", server_name_,
                  " at ", address_.host, " port ", address_.port, " within ",
                  timeout_.count() / 1000.0, " s: ", why_);
  HEMIOLA_THROW(ErrorCode::kCommFailure, "worker ", worker_, ": ", server_name_, " at ",
                address_.host, " port ", address_.port, " admitted it in none of its tries within ",
                timeout_.count() / 1000.0, " s; the last: ", why_);
}

}  // namespace

Socket connect_to_server(Store& store, int server_index, int worker, const std::string& token,
                         std::chrono::milliseconds timeout, const std::string& server_name) {
  const auto deadline = Clock::now() + timeout;
  Dialer dialer(published_address(store, server_index, timeout, server_name), worker, token,
                timeout, deadline, server_name);
  for (;;) {
    Socket s = dialer.connect_once();
    if (s && dialer.hello(s)) return s;
    if (Clock::now() >= deadline) dialer.give_up(bool(s));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace hemiola::ps
