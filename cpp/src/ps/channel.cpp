#include "ps/channel.h"

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include "comm/gloo_setup.h"
#include "hemiola/status.h"

namespace hemiola::ps {

namespace {

// Gloo slots: one for headers and one for payloads, per sending rank.
constexpr uint64_t header_slot(int from_rank) { return 0x5053000 + 2 * from_rank; }
constexpr uint64_t payload_slot(int from_rank) { return 0x5053001 + 2 * from_rank; }

// A receive can wait for as long as a worker computes (a straggler may be
// slow); liveness comes from the transport (a dead peer closes the socket)
// and from the server's watchdog, not from this timeout.
constexpr std::chrono::hours kReceiveWait(24 * 365);

}  // namespace

Channel::Channel(const std::shared_ptr<gloo::transport::Device>& device, Store& store,
                 int my_rank, std::chrono::milliseconds connect_timeout, std::string peer,
                 std::chrono::milliseconds heartbeat)
    : peer_(std::move(peer)), heartbeat_(heartbeat), my_rank_(my_rank), peer_rank_(1 - my_rank) {
  HEMIOLA_CHECK(my_rank == 0 || my_rank == 1, "channel rank must be 0 or 1");
  context_ = connect_gloo_context(my_rank, 2, store, device, connect_timeout);
  last_heard_ = std::chrono::steady_clock::now();
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
    queue_.push_back(Outgoing{header, std::move(payload)});
  }
  changed_.notify_all();
  return true;
}

bool Channel::send_raw(const Header& header, std::vector<char> payload) {
  return enqueue(Outgoing{header, std::move(payload)});
}

bool Channel::enqueue(Outgoing message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_ || !send_failure_.empty()) return false;
    queue_.push_back(std::move(message));
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
  return std::chrono::steady_clock::now() - last_heard_;
}

std::string Channel::send_failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return send_failure_;
}

void Channel::sender_loop() {
  const auto timeout = context_->getTimeout();  // the context outlives this thread
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
        message.header.type = static_cast<uint16_t>(MessageType::kPing);
        message.header.checksum = header_checksum(message.header);
      } else {
        message = std::move(queue_.front());
        queue_.pop_front();
      }
      sending_ = true;
    }
    std::string failure;
    try {
      auto header = context_->createUnboundBuffer(&message.header, sizeof(Header));
      header->send(peer_rank_, header_slot(my_rank_));
      header->waitSend(timeout);
      if (!message.payload.empty()) {
        auto payload = context_->createUnboundBuffer(message.payload.data(), message.payload.size());
        payload->send(peer_rank_, payload_slot(my_rank_));
        payload->waitSend(timeout);
      }
    } catch (const std::exception& e) {
      failure = detail::concat("sending to ", peer_, " failed: ", e.what());
    }
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
  auto receive_into = [&](void* data, size_t bytes, uint64_t slot) {
    auto buffer = context_->createUnboundBuffer(data, bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) return false;
      receiving_ = buffer.get();
    }
    bool completed = false;
    try {  // recv itself throws when the pair already failed
      buffer->recv(peer_rank_, slot);
      completed = buffer->waitRecv(nullptr, kReceiveWait);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mutex_);
      receiving_ = nullptr;
      if (closed_) return false;
      HEMIOLA_THROW(ErrorCode::kCommFailure, "connection to ", peer_, " lost: ", e.what());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    receiving_ = nullptr;
    return completed && !closed_;
  };
  do {
    if (!receive_into(header, sizeof(Header), header_slot(peer_rank_))) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    last_heard_ = std::chrono::steady_clock::now();
  } while (header->type == static_cast<uint16_t>(MessageType::kPing) &&
           header->payload_bytes == 0);  // a ping carries no sequence number for the owner
  payload->clear();
  if (header->payload_bytes > 0) {
    if (header->payload_bytes > kMaxPayloadBytes) {
      HEMIOLA_THROW(ErrorCode::kCommFailure, "protocol violation from ", peer_, ": a payload of ",
                    header->payload_bytes, " bytes; dropping the connection");
    }
    payload->resize(static_cast<size_t>(header->payload_bytes));
    if (!receive_into(payload->data(), payload->size(), payload_slot(peer_rank_))) return false;
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
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  if (receiving_) receiving_->abortWaitRecv();
}

void Channel::disconnect() {
  close();
  context_.reset();
}

}  // namespace hemiola::ps
