// The parameter server's state, shared by its two halves: ps/server.cpp (the
// lifecycle: admission, the receive threads, the watchdog, replies, snapshots)
// and ps/server_requests.cpp (what each worker message does to the keys).
//
// Invariant: every member below `mutex` is read and written with `mutex`
// held; the receive threads (ps/channel.h's receive_loop) hold it while a
// message is handled, and serve()'s watchdog while it checks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "hemiola/ps.h"
#include "hemiola/status.h"
#include "ps/admission.h"
#include "ps/channel.h"
#include "ps/log_limit.h"
#include "ps/optimizer.h"
#include "ps/protocol.h"
#include "ps/table.h"

namespace hemiola::ps {

enum class WorkerState { kConnected, kRegistered, kGone, kDead };

struct Waiting {
  int worker;
  int64_t min_version;
  // eager: the requester's own push follows; answer without that push's
  // momentum share, at the weight it is expected to get (momentum_share_removed).
  bool ahead = false;
  PushWeight weight;
};

struct Key {
  TableEntry entry;
  bool initialized = false;
  int64_t version = 0;
  std::vector<float> param;
  OptimizerState optimizer;
  std::optional<OptimizerHyper> hyper;  // of the newest applied push (an ahead reply steps with it)
  // bsp: the round being aggregated.
  std::vector<float> sum;
  std::vector<uint8_t> contributed;
  int contributions = 0;
  bool any_gradient = false;
  OptimizerHyper round_hyper;
  int round_hyper_from = -1;  // the worker whose gradient set round_hyper
  std::chrono::steady_clock::time_point round_started;
  // ssp/asp/eager: pushes received from each worker.
  std::vector<int64_t> pushes;
  std::vector<Waiting> waiting;
};

// The send queue to one worker holds at most kQueueShardCopies copies of the
// server's shard (a worker that reads its replies has at most a pull of each
// key in flight, two around an eager step) plus kQueueFloorBytes: a worker that
// asks for more than it reads is dropped instead of growing it without bound.
constexpr size_t kQueueFloorBytes = size_t(16) << 20;
constexpr size_t kQueueShardCopies = 4;
// The largest message a worker may send: its largest shard (an init or a
// push), or its registration. Before the first registration the table is
// unknown, so a registration may take kRegistrationFloorBytes; after it,
// the table's size, kSettingsLineBytes per key (a settings line: a key and
// eight exact numbers) and kRegistrationSlackBytes.
// A header that claims more drops the connection before a byte of the
// payload is read, so no worker can make the server buffer 4 GiB for it.
constexpr size_t kRegistrationFloorBytes = size_t(16) << 20;
constexpr size_t kRegistrationSlackBytes = size_t(1) << 20;
constexpr size_t kSettingsLineBytes = 256;
// Pulls of one key from one worker that may wait for an answer (a worker has
// one or two).
constexpr size_t kMaxWaitingPulls = 8;

inline std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

struct Server::Impl {
  ServerOptions opt;
  std::shared_ptr<Store> store;
  std::unique_ptr<Acceptor> acceptor;
  std::vector<std::unique_ptr<Channel>> channels;  // index = worker
  std::vector<std::thread> receivers;
  std::thread refuser;  // while serving: refuses latecomers, drops silent ones

  mutable std::mutex mutex;
  // Refused connections: 10 lines per 10 s at most (guarded by mutex).
  LogLimit refusal_log{10, std::chrono::seconds(10)};
  std::condition_variable changed;
  std::map<int32_t, Key> keys;
  std::string table;  // what every worker must register (empty until the first does)
  OptimizerKind optimizer = OptimizerKind::kSgd;
  // The optimizer settings of the first registration (by key), which every
  // other worker's must equal.
  std::map<int32_t, OptimizerHyper> registered_hyper;
  int registered_hyper_from = -1;
  bool restored = false;
  std::vector<WorkerState> workers;
  std::vector<uint64_t> expected_seq;
  std::string fatal;
  ErrorCode fatal_code = ErrorCode::kCommFailure;
  ServerStats stats;

  std::string who(int w) const {
    return detail::concat("worker ", w, " (rank ", opt.num_servers + w, ")");
  }
  std::string tag() const { return detail::concat("[hemiola ps server ", opt.server_index, "] "); }
  bool live(int w) const {
    const auto s = workers[static_cast<size_t>(w)];
    return s == WorkerState::kConnected || s == WorkerState::kRegistered;
  }

  // ---- replies and failures (server.cpp) ------------------------------------------
  void send(int w, MessageType type, int32_t key, int64_t version = 0, int64_t aux = 0,
            std::vector<char> payload = {}, double factor = 1.0, int32_t flags = 0);
  void send_error(int w, const std::string& message, ErrorCode code = ErrorCode::kInvalidArgument);
  void keep(const std::string& message);
  void remember(const std::string& message);
  void reject(int w, const Header& h, const std::string& why);
  void refused(const std::string& why);
  void fail(const std::string& message, ErrorCode code);
  void on_disconnect(int w, const std::string& what);

  // The send-queue bound of every connection (kQueueFloorBytes until the keys are known).
  size_t queue_limit() const;
  // The largest payload a worker may send now (see kRegistrationFloorBytes).
  size_t payload_limit() const;
  // Sets both bounds on every connection (again once the keys are known).
  void bound_channels();

  // ---- snapshots (server.cpp) -----------------------------------------------------
  void take_snapshot_locked();
  void restore();

  // Worker w's receive thread: hands its messages to handle() until it leaves.
  void receive_from(int w);

  // ---- the watchdog (server.cpp) --------------------------------------------------
  bool everyone_left() const;
  void check_silent_workers();
  void check_stalled_rounds();
  // The watchdog did not run for `gap` (the server was paused or starved):
  // the workers' silence and the rounds' waits during it are the server's,
  // so their clocks move on by `gap` before anyone is blamed.
  void excuse_pause(std::chrono::steady_clock::duration gap);

  // ---- requests (server_requests.cpp) -----------------------------------------------
  void handle(int w, const Header& h, const std::vector<char>& payload);
  void add_keys(const std::vector<TableEntry>& entries);
  void on_register(int w, const Header& h, const std::vector<char>& payload);
  // Checks w's optimizer settings (valid, and the same as the first
  // registration's); false after failing the job.
  bool check_registered_hyper(int w, const std::map<int32_t, OptimizerHyper>& hyper);
  void on_bye(int w);
  void on_init(int w, Key& k, const Header& h, const std::vector<char>& payload);
  void on_pull(int w, Key& k, const Header& h);
  void on_push(int w, Key& k, const Header& h, const std::vector<char>& payload);
  std::string gone_workers() const;
  bool may_read(const Key& k, const Waiting& p) const;
  void answer_pulls(Key& k);
  void answer_all_pulls();
  void apply_bsp(int w, Key& k, const Header& h, const float* grad);
  // A step that made k's parameters non-finite (`who_stepped`: whose
  // setting it was) fails the job; true when it did.
  bool failed_on_non_finite_step(const Key& k, const OptimizerHyper& hyper,
                                 const std::string& who_stepped);
  PushWeight weight_of(const Header& h, int64_t tau) const;
  void apply_async(int w, Key& k, const Header& h, const float* grad);
};

}  // namespace hemiola::ps
