#include "ps/channel.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "hemiola/status.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;

// Payloads are read in pieces of at most this size, so a header that merely
// claims a huge payload costs no memory until the bytes actually arrive.
constexpr size_t kReadChunk = size_t(1) << 20;

}  // namespace

// How often an idle channel pings: often enough that a peer silent for
// timeout_s is surely gone, rarely enough to cost nothing.
std::chrono::milliseconds heartbeat_for(double timeout_s) {
  const auto fifth = std::chrono::milliseconds(static_cast<int64_t>(timeout_s / 5 * 1000.0));
  return std::clamp(fifth, std::chrono::milliseconds(100), std::chrono::milliseconds(5000));
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
  bool queued = false, overflowed = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || !send_failure_.empty()) return false;
    header.seq = next_seq_++;
    header.checksum = header_checksum(header);
    queued = push_locked(frame(header, payload), &overflowed);
  }
  if (overflowed) shut_down_after_overflow();
  changed_.notify_all();
  return queued;
}

bool Channel::send_raw(std::vector<char> bytes) { return enqueue(std::move(bytes)); }

bool Channel::send_raw(const Header& header, const std::vector<char>& payload) {
  return enqueue(frame(header, payload));
}

bool Channel::enqueue(std::vector<char> bytes) {
  bool queued = false, overflowed = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || !send_failure_.empty()) return false;
    queued = push_locked(std::move(bytes), &overflowed);
  }
  if (overflowed) shut_down_after_overflow();
  changed_.notify_all();
  return queued;
}

bool Channel::push_locked(std::vector<char> bytes, bool* overflowed) {
  if (queue_limit_ > 0 && queued_bytes_ + bytes.size() > queue_limit_) {
    // The peer asks for more than it reads: what is queued for it would only
    // grow. Nothing more goes to it; the owner learns why from receive().
    send_failure_ = detail::concat("more than ", queue_limit_, " bytes of messages for ", peer_,
                                   " waited to be sent (", queued_bytes_, " queued, ",
                                   bytes.size(), " more): it does not read what it asks for, "
                                   "so the connection was dropped");
    queue_.clear();
    queued_bytes_ = 0;
    overflowed_ = true;
    *overflowed = true;
    return false;
  }
  queued_bytes_ += bytes.size();
  queue_.push_back(Outgoing{std::move(bytes)});
  return true;
}

void Channel::shut_down_after_overflow() {
  // Unblocks a sender stuck on a full socket buffer and the receive loop,
  // which then reports send_failure_. The socket's close will be abortive
  // (a reset): what the kernel still holds for a peer that reads nothing is
  // dropped, and the peer learns at once that it was cut off.
  if (!socket_) return;
  const linger abort_on_close{1, 0};
  ::setsockopt(socket_.fd(), SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof abort_on_close);
  ::shutdown(socket_.fd(), SHUT_RDWR);
}

bool Channel::overflowed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return overflowed_;
}

void Channel::set_queue_limit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_limit_ = bytes;
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

void Channel::excuse(std::chrono::steady_clock::duration gap) {
  std::lock_guard<std::mutex> lock(mutex_);
  last_heard_ = std::min(Clock::now(), last_heard_ + gap);
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
        queued_bytes_ -= message.bytes.size();
      }
      sending_ = true;
    }
    std::string failure = send_all(socket_.fd(), message.bytes.data(), message.bytes.size());
    if (!failure.empty()) failure = detail::concat("sending to ", peer_, " failed: ", failure);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sending_ = false;
      if (!failure.empty()) {
        if (send_failure_.empty()) send_failure_ = failure;  // an overflow's reason stays
        queue_.clear();
        queued_bytes_ = 0;
      }
    }
    changed_.notify_all();
    if (!failure.empty()) return;
  }
}

bool Channel::receive(Header* header, std::vector<char>* payload) {
  // Reads exactly n bytes; false when close() aborted the wait.
  auto read_exact = [&](char* data, size_t n, const char* what) {
    const size_t got = recv_exact(socket_.fd(), data, n, [&] {
      std::lock_guard<std::mutex> lock(mutex_);
      last_heard_ = Clock::now();
    });
    if (got == n) return true;
    const bool closed_by_peer = errno == 0;
    const std::string error = errno_text();
    if (closed_) return false;
    {  // The channel shut its socket down itself (its send queue overflowed): that is why.
      std::lock_guard<std::mutex> lock(mutex_);
      if (overflowed_) HEMIOLA_THROW(ErrorCode::kCommFailure, send_failure_);
    }
    if (closed_by_peer && got == 0 && std::strcmp(what, "header") == 0)
      HEMIOLA_THROW(ErrorCode::kCommFailure, "connection to ", peer_, " closed");
    if (closed_by_peer)
      HEMIOLA_THROW(ErrorCode::kCommFailure, "connection to ", peer_,
                    " closed in the middle of a message (a truncated ", what, ": ", got, " of ", n,
                    " bytes)");
    HEMIOLA_THROW(ErrorCode::kCommFailure, "connection to ", peer_, " lost: ", error);
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
  if (const size_t limit = payload_limit_.load(std::memory_order_relaxed); limit > 0 && total > limit)
    HEMIOLA_THROW(ErrorCode::kCommFailure, "protocol violation from ", peer_, ": a payload of ",
                  total, " bytes, over the ", limit,
                  " this connection accepts (its largest shard or registration); dropping the "
                  "connection");
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

// ---- the receive loop -------------------------------------------------------------

void receive_loop(Channel& channel, std::mutex& mutex, const MessageHandler& on_message,
                  const LossHandler& on_lost) {
  Header header;
  std::vector<char> payload;
  for (;;) {
    try {
      if (!channel.receive(&header, &payload)) return;  // closed by its owner
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mutex);
      on_lost(e.what());
      return;
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (!on_message(header, payload)) return;
  }
}

}  // namespace hemiola::ps
