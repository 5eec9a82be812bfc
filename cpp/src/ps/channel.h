// One bidirectional message channel between a parameter server and a worker:
// a two-rank Gloo context (rank 0 = server side) carrying Header + payload
// messages over unbound buffers.
//
// Sends are queued and performed by the channel's own sender thread, so a
// caller never blocks on the network (a server's receive loop must never wait
// for a worker to post a receive). Messages arrive in the order they were
// sent. receive() is meant for one thread.
//
// Liveness: when nothing has been sent for `heartbeat`, the sender thread
// sends a ping (which receive() swallows), so a peer that is alive is never
// silent for long, whatever its training thread does; silent_for() lets the
// owner notice a peer whose machine or network vanished without closing the
// connection.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hemiola/store.h"
#include "ps/protocol.h"

namespace gloo {
class Context;
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace hemiola::ps {

// The ping interval for a connection whose peer counts as gone after timeout_s.
std::chrono::milliseconds heartbeat_for(double timeout_s);

class Channel {
 public:
  // Connects through `store` (keys are used as given; pass a PrefixStore).
  // `peer` names the other side in error messages ("server 1", "worker 3").
  // heartbeat 0: never ping (tests use it to play a vanished peer).
  Channel(const std::shared_ptr<gloo::transport::Device>& device, Store& store, int my_rank,
          std::chrono::milliseconds connect_timeout, std::string peer,
          std::chrono::milliseconds heartbeat);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Queues a message; the channel sets seq and checksum. False when the
  // channel has failed or closed (the message is dropped).
  bool send(Header header, std::vector<char> payload = {});
  // Queues a message exactly as given: no seq, no checksum (tests craft
  // malformed messages with it).
  bool send_raw(const Header& header, std::vector<char> payload = {});
  // Waits until everything queued so far has been sent (or the channel failed).
  void drain(std::chrono::milliseconds timeout);

  // Blocks until the next message. Returns false after close(). Throws
  // Error(kCommFailure) when the peer is gone or the stream is broken.
  bool receive(Header* header, std::vector<char>* payload);

  // Stops the sender after the queue drains and aborts a blocked receive.
  void close();
  // After close() and once no thread is inside receive(): destroys the Gloo
  // context, closing the connection. Without it a receive that close() aborted
  // stays posted inside Gloo, and a late message from the peer would make
  // Gloo's event loop spin (and the peer's send hang until its timeout).
  void disconnect();
  const std::string& peer() const { return peer_; }
  // Why sending stopped (empty while healthy).
  std::string send_failure() const;
  // How long since anything (a message or a ping) arrived from the peer.
  std::chrono::steady_clock::duration silent_for() const;

 private:
  struct Outgoing {
    Header header;
    std::vector<char> payload;
  };
  bool enqueue(Outgoing message);
  void sender_loop();

  std::string peer_;
  std::chrono::milliseconds heartbeat_;
  int my_rank_;
  int peer_rank_;
  std::shared_ptr<gloo::Context> context_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Outgoing> queue_;
  bool sending_ = false;  // the sender holds a message outside the queue
  bool closing_ = false;
  std::string send_failure_;
  uint64_t next_seq_ = 0;
  gloo::transport::UnboundBuffer* receiving_ = nullptr;  // guarded by mutex_
  bool closed_ = false;
  std::chrono::steady_clock::time_point last_heard_;  // guarded by mutex_
  std::thread sender_;
};

}  // namespace hemiola::ps
