// The parameter server's connections: plain TCP, one connection per
// (server, worker) pair, carrying Header + payload messages, and the one
// receive loop that both a server and a client run on each of them.
// Admission is in ps/admission.h (the server's side of the handshake) and
// ps/connect.h (the worker's).
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
// receive() is meant for one thread. The queue may be bounded (bytes): a peer
// that asks for more than it reads (pulls whose replies it never takes) would
// otherwise grow it without limit; past the bound the channel fails, and its
// socket is shut down, so its receive() fails too, with that reason.
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
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ps/protocol.h"
#include "ps/socket.h"

namespace hemiola::ps {

// The ping interval for a connection whose peer counts as gone after timeout_s.
std::chrono::milliseconds heartbeat_for(double timeout_s);

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
  // when the channel has failed or closed (the message is dropped), or when
  // queueing it would exceed the queue's bound: the channel then fails.
  bool send(Header header, std::vector<char> payload = {});
  // Bounds the bytes waiting in the send queue (0: no bound, the default).
  void set_queue_limit(size_t bytes);
  // Receives refuse a header whose payload is over `bytes` (0: only the
  // protocol's kMaxPayloadBytes), as a protocol violation, before reading it.
  void set_payload_limit(size_t bytes) { payload_limit_.store(bytes, std::memory_order_relaxed); }
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
  // The send queue exceeded its bound: the socket is shut down, and its
  // close (disconnect()) resets the connection.
  bool overflowed() const;
  // How long since anything (a message or a ping) arrived from the peer.
  std::chrono::steady_clock::duration silent_for() const;
  // This process did not run for `gap` (it was paused, or starved of CPU):
  // what the peer sent meanwhile waits unread in the socket, so that time
  // does not count as the peer's silence.
  void excuse(std::chrono::steady_clock::duration gap);

 private:
  struct Outgoing {
    std::vector<char> bytes;  // header and payload, ready for the wire
  };
  bool enqueue(std::vector<char> bytes);
  // Lock held: queues `bytes`, or fails the channel when they would exceed
  // the bound (true in `overflowed`: the caller then shuts the socket down).
  bool push_locked(std::vector<char> bytes, bool* overflowed);
  // After an overflow: wakes the sender and a blocked receive.
  void shut_down_after_overflow();
  void sender_loop();

  std::string peer_;
  std::chrono::milliseconds heartbeat_;
  Socket socket_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Outgoing> queue_;
  size_t queued_bytes_ = 0;  // in queue_
  size_t queue_limit_ = 0;   // 0: no bound
  bool overflowed_ = false;  // the bound was exceeded: the channel shut its socket down
  bool sending_ = false;  // the sender holds a message outside the queue
  bool closing_ = false;
  std::string send_failure_;
  uint64_t next_seq_ = 0;
  std::atomic<bool> closed_{false};
  std::atomic<size_t> payload_limit_{0};  // set_payload_limit; 0: the protocol's bound
  std::chrono::steady_clock::time_point last_heard_;  // guarded by mutex_
  std::thread sender_;
};

// A watchdog that wakes this much later than it asked to: its process did not
// run meanwhile (paused, or starved of CPU); see Channel::excuse.
constexpr std::chrono::milliseconds kPauseGap{2000};

// What the owner of a channel does with each message; false ends the loop
// (the peer said goodbye).
using MessageHandler = std::function<bool(const Header& header, const std::vector<char>& payload)>;
// What the owner does when the peer is gone or broke the framing (`why`).
using LossHandler = std::function<void(const std::string& why)>;

// The receive loop of both sides: a server runs one per worker, a client one
// per server, each on its own thread. Every message goes to `on_message` with
// `mutex` (the owner's state lock) held, so handlers never race each other or
// the owner's other threads. Returns after close(), when `on_message` returns
// false, or after `on_lost` (also called with `mutex` held) when the
// connection failed.
void receive_loop(Channel& channel, std::mutex& mutex, const MessageHandler& on_message,
                  const LossHandler& on_lost);

}  // namespace hemiola::ps
