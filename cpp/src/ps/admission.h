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
  // Admits the connection of a complete hello, or refuses it (a wrong token,
  // an index outside the job or taken already).
  void admit_or_refuse(Pending& p, bool admitting, std::vector<Socket>& admitted);
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
  std::atomic<bool> stopped_{false};
};

}  // namespace hemiola::ps
