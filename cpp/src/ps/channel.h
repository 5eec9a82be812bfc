// The parameter server's connections: plain TCP, one connection per
// (server, worker) pair, carrying Header + payload messages.
//
// Why not Gloo pairs (as the engine's collectives use): a Gloo pair accepts
// the first TCP connection to its port, whoever makes it, and enforces its
// framing with GLOO_ENFORCE on its event-loop thread, so a malformed or
// oversized message from the peer terminates the whole process. A server must
// survive hostile input, so it owns its sockets: it binds one chosen address,
// admits only connections that introduce themselves (hello + job token) within
// timeout_s, and a stream that breaks the framing closes that one connection.
//
// Sends are queued and performed by the channel's own sender thread, so a
// caller never blocks on the network (a server's receive loop must never wait
// for a worker to read). Messages arrive in the order they were sent.
// receive() is meant for one thread.
//
// Liveness: when nothing has been sent for `heartbeat`, the sender thread
// sends a ping (which receive() swallows), so a peer that is alive is never
// silent for long, whatever its training thread does; silent_for() lets the
// owner notice a peer whose machine or network vanished without closing the
// connection.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_setup.h"
#include "hemiola/store.h"
#include "ps/protocol.h"

namespace hemiola::ps {

// The ping interval for a connection whose peer counts as gone after timeout_s.
std::chrono::milliseconds heartbeat_for(double timeout_s);

// The address a server binds, from the same choice the engine makes for Gloo:
// the interface `spec.iface`'s address, else `spec.hostname`, else the local
// address that routes to master_addr, else the host name's address. Never the
// wildcard address unless the caller named it.
std::string bind_address(const BindSpec& spec);

// The store key under which server `server_index` publishes its address
// ("HOST PORT"), or, if it failed to start, startup_failure(why).
std::string address_key(int server_index);
std::string startup_failure(const std::string& why);

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

class Channel {
 public:
  // Takes over a connected socket whose handshake is done. `peer` names the
  // other side in error messages ("server 1", "worker 3"); a send that cannot
  // complete within `send_timeout` fails the channel. heartbeat 0: never ping
  // (tests use it to play a vanished peer).
  Channel(Socket socket, std::string peer, std::chrono::milliseconds send_timeout,
          std::chrono::milliseconds heartbeat);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Queues a message; the channel sets seq, payload_bytes and checksum. False
  // when the channel has failed or closed (the message is dropped).
  bool send(Header header, std::vector<char> payload = {});
  // Queues bytes exactly as given: no framing, no seq, no checksum (tests craft
  // malformed, truncated and replayed messages with it).
  bool send_raw(std::vector<char> bytes);
  // Queues a header exactly as given, followed by `payload` (tests).
  bool send_raw(const Header& header, const std::vector<char>& payload = {});
  // Waits until everything queued so far has been sent (or the channel failed).
  void drain(std::chrono::milliseconds timeout);

  // Blocks until the next message. Returns false after close(). Throws
  // Error(kCommFailure) when the peer is gone or breaks the framing (bad
  // magic, protocol or checksum, an oversized payload): the rest of such a
  // stream cannot be trusted, so the connection must be dropped.
  bool receive(Header* header, std::vector<char>* payload);

  // Stops the sender after the queue drains and aborts a blocked receive.
  void close();
  // After close() and once no thread is inside receive(): closes the socket.
  void disconnect();
  const std::string& peer() const { return peer_; }
  // Why sending stopped (empty while healthy).
  std::string send_failure() const;
  // How long since anything (a message or a ping) arrived from the peer.
  std::chrono::steady_clock::duration silent_for() const;

 private:
  struct Outgoing {
    std::vector<char> bytes;  // header and payload, ready for the wire
  };
  bool enqueue(std::vector<char> bytes);
  void sender_loop();

  std::string peer_;
  std::chrono::milliseconds heartbeat_;
  Socket socket_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Outgoing> queue_;
  bool sending_ = false;  // the sender holds a message outside the queue
  bool closing_ = false;
  std::string send_failure_;
  uint64_t next_seq_ = 0;
  std::atomic<bool> closed_{false};
  std::chrono::steady_clock::time_point last_heard_;  // guarded by mutex_
  std::thread sender_;
};

// How long a server waits for the hello of a connection (at most; less when
// the job's timeout is shorter).
constexpr std::chrono::milliseconds kHelloTimeout{10000};

// Why a connection was refused, for the server's log and statistics.
using RefusalHandler = std::function<void(const std::string& why)>;

// A server's listening socket and its admission rule. A connection is admitted
// as worker w only when, within `hello_timeout` of connecting, it sends a
// well-formed hello for a free worker index in [0, num_workers) carrying the
// job token; anything else (silence, random bytes, a truncated or oversized
// hello, a wrong or missing token, a taken index) is answered with an error
// where possible and closed, and the server's state never sees it. Polls, so
// one slow or silent connection never delays another.
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
  // One poll round; `admitting`: hellos may take free slots.
  void poll_once(std::chrono::milliseconds wait, bool admitting, std::vector<Socket>& admitted,
                 int& count);
  void refuse(Pending& p, const std::string& why, bool tell);

  Socket listener_;
  int wake_[2] = {-1, -1};  // a pipe: stop() writes to interrupt poll()
  std::string address_;
  std::string token_;
  int num_workers_;
  std::chrono::milliseconds hello_timeout_;
  std::string server_name_;
  RefusalHandler on_refused_;
  std::vector<std::unique_ptr<Pending>> pending_;
  std::atomic<bool> stopped_{false};
};

// The worker side of the handshake: connects to the server published under
// address_key(server_index), says hello as `worker` with `token`, and returns
// the socket once welcomed. Throws Error(kAborted) with the server's reason
// when refused, Error(kTimeout) when the server cannot be reached in time.
Socket connect_to_server(Store& store, int server_index, int worker, const std::string& token,
                         std::chrono::milliseconds timeout, const std::string& server_name);

// Both sides' view of a hello header (tests use it to craft hostile ones).
Header hello_header(int worker, const std::string& token);

}  // namespace hemiola::ps
