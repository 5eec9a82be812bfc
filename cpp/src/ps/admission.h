// The server's side of the handshake: a listening socket that admits only
// connections introducing themselves as a worker of this job.
//
// A connection is admitted as worker w only when, within `hello_timeout` of
// connecting, it sends a well-formed hello for a free worker index in
// [0, num_workers) carrying the job token; anything else (silence, random
// bytes, a truncated or oversized hello, a wrong or missing token, a taken
// index) is answered with an error where possible and closed, and the
// server's state never sees it. The worker's side is ps/connect.h.
#pragma once

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ps/socket.h"

namespace hemiola::ps {

// How long a server waits for the hello of a connection (at most; less when
// the job's timeout is shorter).
constexpr std::chrono::milliseconds kHelloTimeout{10000};

// Token checks a server does at most, a second and at once: each tells the
// sender whether its token is the job's, so a stranger guessing it gets no
// more answers than this (a check that admits a worker costs nothing). A
// complete hello beyond the budget waits, unread past its hello, for its turn
// in arrival order; while 64 such hellos wait, newcomers wait in the kernel's
// queue, unaccepted, so a flood costs the server almost nothing.
constexpr double kTokenChecksPerSecond = 20;
constexpr double kTokenCheckBurst = 10;

// A token bucket: `per_second` units a second, at most `burst` saved up.
class CheckBudget {
 public:
  using Clock = std::chrono::steady_clock;
  CheckBudget(double per_second, double burst)
      : per_second_(per_second), burst_(burst), units_(burst) {}
  // Takes one unit for a check at `now`; false when none is left.
  bool take(Clock::time_point now);
  // The check admitted a worker: it costs nothing.
  void give_back() { units_ = std::min(burst_, units_ + 1); }
  // How long from `now` until a unit can be taken (zero when one can).
  std::chrono::milliseconds until_next(Clock::time_point now);

 private:
  void refill(Clock::time_point now);
  const double per_second_, burst_;
  double units_;
  Clock::time_point last_{};
  bool started_ = false;
};

// Why a connection was refused, for the server's log and statistics.
using RefusalHandler = std::function<void(const std::string& why)>;

// Polls every connection that has not yet said hello, so one slow or silent
// connection never delays another.
class Acceptor {
 public:
  Acceptor(const std::string& address, std::string token, int num_workers,
           std::chrono::milliseconds hello_timeout, std::string server_name,
           RefusalHandler on_refused);
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;

  // "host port": what workers connect to (published in the store).
  std::string address() const { return address_; }
  // Admits until every worker index is taken; returns the sockets by worker.
  // Throws Error(kTimeout) naming the missing workers at `deadline`.
  std::vector<Socket> admit_all(std::chrono::steady_clock::time_point deadline);
  // Refuses every newcomer (the job is complete) until stop() is called.
  void refuse_until_stopped();
  void stop();

 private:
  struct Pending;
  // One round: waits up to `wait` for activity, reads what the pending
  // connections sent, drops the silent ones, then takes newcomers.
  // `admitting`: a complete hello may take a free slot of `admitted` (by
  // worker index); otherwise every hello is refused.
  void poll_once(std::chrono::milliseconds wait, bool admitting, std::vector<Socket>& admitted);
  // poll() over the listener, the wake pipe and pending_ (in that order);
  // every revents is 0 when nothing happened.
  std::vector<pollfd> wait_for_activity(std::chrono::milliseconds wait);
  // Reads what arrived of p's hello; true once it is complete (p is refused,
  // and false returned, as soon as its header is unacceptable).
  bool read_hello(Pending& p);
  // Checks the complete hellos, in arrival order, while budget_ allows.
  void check_waiting(bool admitting, std::vector<Socket>& admitted);
  // Admits the connection of a complete hello, or refuses it (a wrong token,
  // an index outside the job or taken already). True when admitted.
  bool admit_or_refuse(Pending& p, bool admitting, std::vector<Socket>& admitted);
  void drop_silent();
  void accept_newcomers();
  void refuse(Pending& p, const std::string& why, bool tell);

  Socket listener_;
  int wake_[2] = {-1, -1};  // a pipe: stop() writes to interrupt poll()
  std::string address_;
  std::string token_;
  int num_workers_;
  std::chrono::milliseconds hello_timeout_;
  std::string server_name_;
  RefusalHandler on_refused_;
  std::vector<std::unique_ptr<Pending>> pending_;  // in arrival order
  CheckBudget budget_{kTokenChecksPerSecond, kTokenCheckBurst};
  std::atomic<bool> stopped_{false};
};

}  // namespace hemiola::ps
