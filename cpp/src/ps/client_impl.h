// The worker side's state, shared by its two halves: ps/client.cpp (the
// connections: handshake, messages in and out, waiting, failures, close) and
// ps/client_push_pull.cpp (pushes, pulls and eager's local correction).
//
// Invariant: every member below `mutex` is read and written with `mutex`
// held; the receive threads (ps/channel.h's receive_loop) hold it while a
// reply is handled, the training thread while it sends or waits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hemiola/ps.h"
#include "hemiola/status.h"
#include "ps/channel.h"
#include "ps/optimizer.h"
#include "ps/protocol.h"

namespace hemiola::ps {

struct KeyState {
  std::vector<float> staging;
  int64_t requested = 0;        // pulls sent
  int64_t arrived = 0;          // pull replies received
  int64_t arrived_version = 0;  // version of the newest reply
  int64_t used_version = 0;     // version the caller last took (gradients are computed on it)
  int64_t min_next = 0;         // bsp: the version the next pull must wait for (0: none yet)
  int64_t unacked = 0;          // pushes not yet acknowledged
  // Local correction (eager). Invariant: `own` holds the gradient of the
  // newest push, and `pushes_since_request` counts the pushes sent after the
  // newest pull request. A connection delivers in order and an eager server
  // answers a pull on receipt, so a reply contains exactly the pushes sent
  // before its request.
  std::vector<float> own;
  OptimizerHyper own_hyper;  // what the push carried (the server steps with it)
  bool own_is_gradient = false;
  int64_t pushes_since_request = 0;
  std::vector<float> own_sq;   // Adam: a running second moment of this worker's gradients
  int64_t own_pushes = 0;      // Adam: gradient pushes (bias correction of own_sq)
  int64_t last_staleness = 0;  // of the newest acknowledged gradient push
  bool corrected = false;      // the value taken last had the own push applied locally
};

struct Client::Impl {
  ClientOptions opt;
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  std::vector<Shard> shards;
  std::vector<std::vector<int32_t>> keys_of_tensor;
  std::shared_ptr<Store> store;
  std::vector<std::unique_ptr<Channel>> channels;  // index = server
  std::vector<std::thread> receivers;

  mutable std::mutex mutex;
  std::condition_variable changed;
  std::vector<KeyState> keys;
  std::vector<OptimizerHyper> hyper;  // per tensor
  int64_t outstanding = 0;   // pushes not yet acknowledged
  int registered = 0;
  int snapshots_done = 0;
  std::deque<PushRecord> records;  // the newest kMaxRecords
  StalenessSummary summary;
  std::vector<uint64_t> expected_seq;  // per server
  std::string failure;
  ErrorCode failure_code = ErrorCode::kCommFailure;
  bool closing = false;  // close() has begun: no new requests
  bool closed = false;   // the channels are closing: connection errors are expected

  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(opt.timeout_s * 1000.0));
  }
  std::string server_name(int s) const { return detail::concat("server ", s, " (rank ", s, ")"); }
  void throw_if_failed() const {
    if (!failure.empty()) throw Error(failure_code, failure);
  }
  void require_open() const {
    if (closing) HEMIOLA_THROW(ErrorCode::kInvalidArgument, "the parameter-server client of "
                               "worker ", opt.worker_index, " is closed");
  }

  // ---- the connections (client.cpp) -------------------------------------------------
  // Waits (lock held) until `done`, a failure, or the timeout; `what` names the wait.
  void wait(std::unique_lock<std::mutex>& lock, const std::function<bool()>& done,
            const std::string& what);
  void check_silent_servers();
  void send(const Shard& shard, MessageType type, int64_t version, std::vector<char> payload,
            int tensor, int32_t flags = 0, int64_t aux = 0);
  void send_on(int server, const Header& h, std::vector<char> payload);
  void send_control(int server, MessageType type, std::vector<char> payload = {});
  void set_failure(const std::string& message, ErrorCode code);
  void on_message(int s, const Header& h, const std::vector<char>& payload);
  void on_push_ack(const Header& h);
  // Server s's receive thread: hands its replies to on_message() until close().
  void receive_from(int s);

  // ---- pushes and pulls (client_push_pull.cpp) --------------------------------------
  const std::vector<int32_t>& keys_of(int tensor) const;
  void push(int tensor, const float* grad);
  void remember_own(KeyState& k, int tensor, const float* grad);
  void correct_locally(const KeyState& k, int64_t version, float* dst) const;
};

}  // namespace hemiola::ps
