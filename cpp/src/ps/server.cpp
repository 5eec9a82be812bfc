// The parameter server: one receive thread per worker connection applies
// messages to the shared state under one mutex; replies go through each
// channel's own sender thread, so a receive loop never blocks on the network.
// serve()'s thread is the watchdog: it ends the run when every worker has left,
// fails a bsp run whose round waits too long, and takes periodic snapshots.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "comm/gloo_setup.h"
#include "hemiola/ps.h"
#include "hemiola/status.h"
#include "ps/address.h"
#include "ps/admission.h"
#include "ps/channel.h"
#include "ps/log_limit.h"
#include "ps/optimizer.h"
#include "ps/protocol.h"
#include "ps/snapshot.h"
#include "ps/table.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;

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
  Clock::time_point round_started;
  // ssp/asp/eager: pushes received from each worker.
  std::vector<int64_t> pushes;
  std::vector<Waiting> waiting;
};

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

}  // namespace

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

  // ---- replies -------------------------------------------------------------

  bool live(int w) const {
    const auto s = workers[static_cast<size_t>(w)];
    return s == WorkerState::kConnected || s == WorkerState::kRegistered;
  }

  void send(int w, MessageType type, int32_t key, int64_t version = 0, int64_t aux = 0,
            std::vector<char> payload = {}, double factor = 1.0, int32_t flags = 0) {
    // A worker that left or died receives nothing more (its connection is closing).
    if (!live(w)) return;
    Header h;
    h.flags = flags;
    h.type = static_cast<uint16_t>(type);
    h.key = key;
    h.worker = w;
    h.version = version;
    h.aux = aux;
    h.factor = factor;
    channels[static_cast<size_t>(w)]->send(h, std::move(payload));
  }

  // aux carries the ErrorCode the worker should raise.
  void send_error(int w, const std::string& message, ErrorCode code = ErrorCode::kInvalidArgument) {
    send(w, MessageType::kError, -1, 0, static_cast<int64_t>(code),
         std::vector<char>(message.begin(), message.end()));
  }

  // Kept for stats(); printed by the caller.
  void keep(const std::string& message) {
    stats.rejections.push_back(message);
    if (stats.rejections.size() > 32) stats.rejections.erase(stats.rejections.begin());
  }

  void remember(const std::string& message) {
    keep(message);
    std::cerr << tag() << message << std::endl;
  }

  void reject(int w, const Header& h, const std::string& why) {
    const std::string message = detail::concat(
        "server ", opt.server_index, " rejected a ", message_type_name(h.type), " message from ",
        who(w), " (key ", h.key, ", seq ", h.seq, "): ", why, ". It was not applied.");
    stats.rejected += 1;
    remember(message);
    send_error(w, message);
  }

  // A connection refused at the handshake: it never became a worker, so only
  // the counters change.
  // Anyone can open connections: the lines they cause are rate-limited and
  // written after the lock is released, so a flood cannot stall training.
  void refused(const std::string& why) {
    std::string line;
    {
      std::lock_guard<std::mutex> lock(mutex);
      stats.refused += 1;
      const std::string message = detail::concat("server ", opt.server_index, " ", why);
      keep(message);
      line = refusal_log.admit(message, Clock::now());
    }
    if (!line.empty()) std::cerr << tag() << line << std::endl;
  }

  // Empty when every element is finite; else which one (of the whole tensor) is not.
  static std::string non_finite(const float* grad, const Shard& shard) {
    for (int64_t i = 0; i < shard.count; ++i)
      if (!std::isfinite(grad[i]))
        return detail::concat("element ", shard.begin + i, " is ", grad[i]);
    return {};
  }

  void fail(const std::string& message, ErrorCode code) {
    if (!fatal.empty()) return;
    fatal = message;
    fatal_code = code;
    std::cerr << tag() << message << std::endl;
    for (int w = 0; w < opt.num_workers; ++w) send_error(w, message, code);
    changed.notify_all();
  }

  // ---- pulls -----------------------------------------------------------------

  bool may_read(const Key& k, const Waiting& p) const {
    if (!k.initialized) return false;
    switch (opt.consistency) {
      case Consistency::kBsp: return k.version >= p.min_version;
      case Consistency::kSsp: {
        int64_t slowest = k.pushes[static_cast<size_t>(p.worker)];
        for (int w = 0; w < opt.num_workers; ++w)
          if (live(w)) slowest = std::min(slowest, k.pushes[static_cast<size_t>(w)]);
        return k.pushes[static_cast<size_t>(p.worker)] - slowest <= opt.staleness_bound;
      }
      case Consistency::kAsp:
      case Consistency::kEager: return true;
    }
    return true;
  }

  void answer_pulls(Key& k) {
    auto& q = k.waiting;
    for (auto it = q.begin(); it != q.end();) {
      if (!may_read(k, *it)) {
        ++it;
        continue;
      }
      std::vector<char> payload(k.param.size() * sizeof(float));
      if (it->ahead && k.hyper)
        momentum_share_removed(k.optimizer, k.param.data(),
                               reinterpret_cast<float*>(payload.data()), k.entry.shard.count,
                               *k.hyper, it->weight);
      else
        std::memcpy(payload.data(), k.param.data(), payload.size());
      send(it->worker, MessageType::kPullReply, k.entry.shard.key, k.version, 0, std::move(payload));
      stats.pulls_answered += 1;
      it = q.erase(it);
    }
  }

  void answer_all_pulls() {
    for (auto& [id, k] : keys) answer_pulls(k);
  }

  // ---- pushes ----------------------------------------------------------------

  void apply_bsp(int w, Key& k, const Header& h, const float* grad) {
    const auto n = static_cast<size_t>(k.entry.shard.count);
    if (k.contributions == 0) {
      k.sum.assign(n, 0.0f);
      k.contributed.assign(static_cast<size_t>(opt.num_workers), 0);
      k.any_gradient = false;
      k.round_started = Clock::now();
    }
    k.contributed[static_cast<size_t>(w)] = grad ? 1 : 2;
    k.contributions += 1;
    if (grad) {
      for (size_t i = 0; i < n; ++i) k.sum[i] += grad[i];
      k.any_gradient = true;
      k.round_hyper = get_hyper(h);
    }
    if (k.contributions < opt.num_workers) return;
    // The round is complete: the averaged gradient steps once, as all-reduce would.
    const int64_t applied_at = k.version;
    if (k.any_gradient) {
      const float scale = 1.0f / static_cast<float>(opt.num_workers);
      for (auto& g : k.sum) g *= scale;
      optimizer_step(k.optimizer, k.param.data(), k.sum.data(), k.entry.shard.count,
                     k.round_hyper, PushWeight{});
    }
    k.version += 1;
    k.contributions = 0;
    stats.pushes_applied += opt.num_workers;
    for (int v = 0; v < opt.num_workers; ++v)
      send(v, MessageType::kPushAck, k.entry.shard.key, applied_at, applied_at, {}, 1.0,
           k.contributed[static_cast<size_t>(v)] == 2 ? kFlagNoGradient : 0);
    answer_pulls(k);
  }

  // A push `tau` versions stale, by the staleness and momentum rules its
  // worker declares (checked to be known when the message arrived).
  PushWeight weight_of(const Header& h, int64_t tau) const {
    return push_weight(static_cast<StalenessRule>(h.rule),
                       static_cast<MomentumRule>(h.momentum_rule), tau, opt.num_workers);
  }

  void apply_async(int w, Key& k, const Header& h, const float* grad) {
    const PushWeight weight = weight_of(h, k.version - h.version);
    const int64_t applied_at = k.version;
    if (grad) {
      k.hyper = get_hyper(h);
      optimizer_step(k.optimizer, k.param.data(), grad, k.entry.shard.count, *k.hyper, weight);
      k.version += 1;
    }
    k.pushes[static_cast<size_t>(w)] += 1;
    stats.pushes_applied += 1;
    send(w, MessageType::kPushAck, k.entry.shard.key, h.version, applied_at, {}, weight.factor,
         grad ? 0 : kFlagNoGradient);
    answer_pulls(k);  // the ssp bound is per key: only this key's waiters can move
  }

  // ---- one message -------------------------------------------------------------

  void handle(int w, const Header& h, const std::vector<char>& payload) {
    if (const auto problem = header_problem(h); !problem.empty()) return reject(w, h, problem);
    auto& expected = expected_seq[static_cast<size_t>(w)];
    if (h.seq != expected)
      return reject(w, h, detail::concat("out of order: sequence number ", h.seq, ", expected ",
                                         expected));
    expected += 1;
    if (h.worker != w)
      return reject(w, h, detail::concat("it claims to come from worker ", h.worker));
    if (static_cast<size_t>(h.payload_bytes) != payload.size())
      return reject(w, h, "payload size differs from the header's");
    const auto type = static_cast<MessageType>(h.type);
    auto& state = workers[static_cast<size_t>(w)];

    if (type == MessageType::kRegister) return on_register(w, h, payload);
    if (type == MessageType::kBye) return on_bye(w);
    if (state != WorkerState::kRegistered) return reject(w, h, "the worker has not registered");
    if (type == MessageType::kSnapshot) {
      if (opt.snapshot_path.empty())
        return send_error(w, detail::concat("server ", opt.server_index,
                                            " has no snapshot path configured"));
      take_snapshot_locked();
      return send(w, MessageType::kSnapshotDone, -1);
    }
    auto found = keys.find(h.key);
    if (found == keys.end())
      return reject(w, h, detail::concat("server ", opt.server_index, " holds no key ", h.key));
    Key& k = found->second;
    const auto bytes = static_cast<size_t>(k.entry.shard.count) * sizeof(float);
    if (h.rule < 0 || h.rule > static_cast<int32_t>(StalenessRule::kZhang) ||
        h.momentum_rule < 0 || h.momentum_rule > static_cast<int32_t>(MomentumRule::kRescaled))
      return reject(w, h, detail::concat("unknown staleness rule ", h.rule, " or momentum rule ",
                                         h.momentum_rule));

    switch (type) {
      case MessageType::kInit:
        if (w != 0) return reject(w, h, "only worker 0 sends initial values");
        if (payload.size() != bytes)
          return reject(w, h, detail::concat("expected ", bytes, " bytes of initial values"));
        if (k.initialized) return;  // restored from a snapshot: the snapshot wins
        k.param.resize(static_cast<size_t>(k.entry.shard.count));
        std::memcpy(k.param.data(), payload.data(), bytes);
        k.initialized = true;
        return answer_pulls(k);
      case MessageType::kPull: {
        // An ahead pull's aux: the staleness of the requester's previous push,
        // which its next one is expected to have (push_weight clamps it).
        const bool ahead = opt.consistency == Consistency::kEager && (h.flags & kFlagAhead);
        k.waiting.push_back({w, h.version, ahead, ahead ? weight_of(h, h.aux) : PushWeight{}});
        return answer_pulls(k);
      }
      case MessageType::kPush:
      case MessageType::kPushNone: {
        const bool has_grad = type == MessageType::kPush;
        if (has_grad && payload.size() != bytes)
          return reject(w, h, detail::concat("a gradient of ", payload.size(), " bytes for '",
                                             k.entry.name, "' [", k.entry.shard.begin, ", +",
                                             k.entry.shard.count, "), expected ", bytes));
        if (!k.initialized) return reject(w, h, "the key has no initial value yet");
        if (h.version < 0 || h.version > k.version)
          return reject(w, h, detail::concat("computed on version ", h.version,
                                             ", but the key is at version ", k.version));
        const auto* grad = has_grad ? reinterpret_cast<const float*>(payload.data()) : nullptr;
        if (grad && opt.check_finite) {
          if (const auto bad = non_finite(grad, k.entry.shard); !bad.empty()) {
            const std::string what = detail::concat(
                who(w), " pushed a non-finite gradient for parameter '", k.entry.name, "' (",
                bad, "), computed on version ", h.version, ". It was not applied. Lower the "
                "learning rate, clip gradients or check the inputs (check_finite=False turns "
                "this check off)");
            // bsp cannot complete the round without it; asynchronous modes go on.
            if (opt.consistency == Consistency::kBsp) {
              stats.rejected += 1;
              return fail(what, ErrorCode::kInvalidArgument);
            }
            return reject(w, h, what);
          }
        }
        if (opt.consistency == Consistency::kBsp) {
          if (h.version != k.version)
            return reject(w, h, detail::concat("bsp gradient computed on version ", h.version,
                                               ", but this round steps version ", k.version));
          if (k.contributions > 0 && k.contributed[static_cast<size_t>(w)])
            return reject(w, h, "a second gradient in the same bsp round");
          if (const auto gone = gone_workers(); !gone.empty())
            return fail(detail::concat("bsp round ", k.version, " of '", k.entry.name,
                                       "' needs every worker, but ", gone,
                                       " already left (finished its iterations or exited). "
                                       "Every worker must run the same number of iterations."),
                        ErrorCode::kTimeout);
          return apply_bsp(w, k, h, grad);
        }
        return apply_async(w, k, h, grad);
      }
      default:
        return reject(w, h, "not a worker-to-server message");
    }
  }

  // The keys of a table (the first registration's, or a restored snapshot's).
  void add_keys(const std::vector<TableEntry>& entries) {
    for (const auto& e : entries) {
      Key k;
      k.entry = e;
      k.optimizer.kind = optimizer;
      k.pushes.assign(static_cast<size_t>(opt.num_workers), 0);
      keys.emplace(e.shard.key, std::move(k));
    }
  }

  void on_register(int w, const Header& h, const std::vector<char>& payload) {
    if (workers[static_cast<size_t>(w)] != WorkerState::kConnected)
      return reject(w, h, "the worker registered twice");
    if (h.aux != static_cast<int64_t>(opt.consistency)) {
      const auto theirs = static_cast<Consistency>(h.aux);
      return fail(detail::concat(
                      who(w), " runs consistency '",
                      h.aux >= 0 && h.aux <= 3 ? consistency_name(theirs) : "unknown",
                      "' but server ", opt.server_index, " runs '",
                      consistency_name(opt.consistency),
                      "': give servers and workers the same consistency"),
                  ErrorCode::kInvalidArgument);
    }
    const std::string text(payload.begin(), payload.end());
    if (table.empty()) {
      std::vector<TableEntry> entries;
      try {
        entries = parse_table(text, &optimizer);
      } catch (const Error& e) {
        return reject(w, h, e.what());
      }
      table = text;
      add_keys(entries);
    } else if (const auto diff = first_difference(table, text); !diff.empty()) {
      return fail(detail::concat("the model of ", who(w), " differs from ",
                                 restored ? "the restored snapshot's" : "the first registered",
                                 " (server ", opt.server_index, "'s shard table, ", diff,
                                 "). Every worker must wrap the same model with the same "
                                 "optimizer type and partition size."),
                  ErrorCode::kInvalidArgument);
    }
    workers[static_cast<size_t>(w)] = WorkerState::kRegistered;
    send(w, MessageType::kRegistered, -1, 0, restored ? 1 : 0);
  }

  std::string gone_workers() const {
    std::string names;
    for (int v = 0; v < opt.num_workers; ++v)
      if (workers[static_cast<size_t>(v)] == WorkerState::kGone)
        names += (names.empty() ? "" : ", ") + who(v);
    return names;
  }

  void on_bye(int w) {
    workers[static_cast<size_t>(w)] = WorkerState::kGone;
    for (auto& [id, k] : keys) {
      // Its pulls will never be taken (and nothing more is sent to it).
      k.waiting.erase(std::remove_if(k.waiting.begin(), k.waiting.end(),
                                     [w](const Waiting& p) { return p.worker == w; }),
                      k.waiting.end());
      if (opt.consistency == Consistency::kBsp && k.contributions > 0 &&
          !k.contributed[static_cast<size_t>(w)]) {
        return fail(detail::concat(who(w), " left while bsp round ", k.version, " of '",
                                   k.entry.name, "' still needed its gradient. Every worker "
                                   "must run the same number of iterations."),
                    ErrorCode::kTimeout);
      }
    }
    answer_all_pulls();  // ssp: a finished worker no longer holds the others back
    changed.notify_all();
  }

  void on_disconnect(int w, const std::string& what) {
    auto& state = workers[static_cast<size_t>(w)];
    if (state == WorkerState::kGone) return;  // said goodbye first: a normal exit
    if (state == WorkerState::kDead) return;  // already declared (silent, then the socket)
    state = WorkerState::kDead;
    stats.dead_workers.push_back(w);
    stats.rejections.push_back(detail::concat(who(w), " disconnected: ", what));
    if (stats.rejections.size() > 32) stats.rejections.erase(stats.rejections.begin());
    changed.notify_all();
    if (!fatal.empty()) return;
    if (opt.consistency == Consistency::kBsp) {
      return fail(detail::concat(who(w), " disconnected before finishing (", what,
                                 "). bsp needs every worker's gradient in every round, so the "
                                 "job cannot go on: restart it (from a snapshot if one exists)."),
                  ErrorCode::kTimeout);
    }
    std::cerr << tag() << who(w) << " disconnected (" << what << "); "
              << consistency_name(opt.consistency) << " goes on without it" << std::endl;
    answer_all_pulls();
  }

  // ---- snapshots ---------------------------------------------------------------

  void take_snapshot_locked() {
    ServerSnapshot s;
    s.server_index = opt.server_index;
    s.num_servers = opt.num_servers;
    s.table = table;
    for (const auto& [id, k] : keys) {
      if (!k.initialized) continue;
      s.keys.push_back(KeySnapshot{id, k.version, k.param, k.optimizer});
    }
    write_snapshot(opt.snapshot_path, s);
    stats.snapshots += 1;
  }

  void restore() {
    ServerSnapshot s = read_snapshot(opt.snapshot_path);
    HEMIOLA_CHECK(s.server_index == opt.server_index && s.num_servers == opt.num_servers,
                  "snapshot ", opt.snapshot_path, " belongs to server ", s.server_index, " of ",
                  s.num_servers, ", not server ", opt.server_index, " of ", opt.num_servers);
    table = s.table;
    add_keys(parse_table(table, &optimizer));
    for (auto& ks : s.keys) {
      auto found = keys.find(ks.key);
      const auto fits = [&](const std::vector<float>& v, bool may_be_empty) {
        return v.size() == static_cast<size_t>(found->second.entry.shard.count) ||
               (may_be_empty && v.empty());
      };
      HEMIOLA_CHECK(found != keys.end() && fits(ks.param, false) && fits(ks.optimizer.m, true) &&
                        fits(ks.optimizer.v, true),
                    "snapshot ", opt.snapshot_path, " is inconsistent at key ", ks.key,
                    "; refusing to load it");
      Key& k = found->second;
      k.param = std::move(ks.param);
      k.version = ks.version;
      k.optimizer = std::move(ks.optimizer);
      k.initialized = true;
    }
    restored = true;
  }

  // ---- threads -------------------------------------------------------------------

  // Worker w's receive thread: hands its messages to handle() until it leaves.
  void receive_from(int w) {
    receive_loop(
        *channels[static_cast<size_t>(w)], mutex,
        [this, w](const Header& h, const std::vector<char>& payload) {
          try {
            handle(w, h, payload);
          } catch (const std::exception& e) {  // e.g. a snapshot that cannot be written
            send_error(w, e.what());
          }
          return workers[static_cast<size_t>(w)] != WorkerState::kGone;  // after its goodbye
        },
        [this, w](const std::string& why) { on_disconnect(w, why); });
  }

  bool everyone_left() const {
    return std::none_of(workers.begin(), workers.end(), [](WorkerState s) {
      return s == WorkerState::kConnected || s == WorkerState::kRegistered;
    });
  }

  // A worker whose connection neither closed nor carried anything (not even
  // its channel's pings) for timeout_s is gone: its machine or network vanished.
  void check_silent_workers() {
    for (int w = 0; w < opt.num_workers; ++w) {
      if (!live(w)) continue;
      const auto silent = channels[static_cast<size_t>(w)]->silent_for();
      if (silent < millis(opt.timeout_s)) continue;
      on_disconnect(w, detail::concat("nothing heard from it, not even a heartbeat, for ",
                                      opt.timeout_s, " s: its machine or network is gone"));
    }
  }

  void check_stalled_rounds() {
    if (opt.consistency != Consistency::kBsp) return;
    const auto now = Clock::now();
    for (const auto& [id, k] : keys) {
      if (k.contributions == 0 || now - k.round_started < millis(opt.timeout_s)) continue;
      std::string missing;
      for (int w = 0; w < opt.num_workers; ++w)
        if (!k.contributed[static_cast<size_t>(w)]) missing += (missing.empty() ? "" : ", ") + who(w);
      return fail(detail::concat("bsp round ", k.version, " of '", k.entry.name, "' (key ", id,
                                 ") waited ", opt.timeout_s, " s for ", missing,
                                 ", which died or stalled. bsp cannot go on without it."),
                  ErrorCode::kTimeout);
    }
  }
};

Server::Server(const ServerOptions& options, std::shared_ptr<Store> store)
    : impl_(std::make_unique<Impl>()) {
  auto& im = *impl_;
  im.opt = options;
  im.store = std::move(store);
  HEMIOLA_CHECK(im.store, "a store is required");
  try {
    start_up(im, options);
  } catch (const std::exception& e) {
    // The workers wait for this key: they learn why at once, instead of
    // waiting out timeout_s for an address that never comes.
    im.store->set(address_key(options.server_index), startup_failure(e.what()));
    throw;
  }
}

void Server::start_up(Impl& im, const ServerOptions& options) {
  HEMIOLA_CHECK(options.num_workers >= 1, "need at least one worker, got ", options.num_workers);
  HEMIOLA_CHECK(options.server_index >= 0 && options.server_index < options.num_servers,
                "server index ", options.server_index, " is outside [0, ", options.num_servers, ")");
  HEMIOLA_CHECK(options.staleness_bound >= 0, "the staleness bound must be >= 0");
  HEMIOLA_CHECK(options.timeout_s > 0, "timeout_s must be positive");
  HEMIOLA_CHECK(!options.restore || !options.snapshot_path.empty(),
                "restore needs a snapshot path");
  im.workers.assign(static_cast<size_t>(options.num_workers), WorkerState::kConnected);
  im.expected_seq.assign(static_cast<size_t>(options.num_workers), 0);
  if (options.restore) im.restore();

  // Listen on the chosen address only, publish it, and admit every worker.
  BindSpec spec{options.iface, options.hostname, options.master_addr, false};
  const std::string name = detail::concat("parameter server ", options.server_index);
  // A worker says hello as soon as it has connected: a connection silent for
  // kHelloTimeout is not one, and must not hold its slot for timeout_s.
  const auto hello_timeout = std::min(millis(options.timeout_s), kHelloTimeout);
  im.acceptor = std::make_unique<Acceptor>(
      bind_address(spec), options.token, options.num_workers, hello_timeout, name,
      [&im](const std::string& why) { im.refused(why); });
  im.store->set(address_key(options.server_index), im.acceptor->address());
  auto sockets = im.acceptor->admit_all(Clock::now() + millis(options.timeout_s));
  for (int w = 0; w < options.num_workers; ++w) {
    im.channels.push_back(std::make_unique<Channel>(std::move(sockets[static_cast<size_t>(w)]),
                                                    im.who(w), millis(options.timeout_s),
                                                    heartbeat_for(options.timeout_s)));
  }
}

Server::~Server() {
  impl_->acceptor->stop();
  if (impl_->refuser.joinable()) impl_->refuser.join();
  for (auto& c : impl_->channels) c->close();
  for (auto& t : impl_->receivers)
    if (t.joinable()) t.join();
}

void Server::serve() {
  auto& im = *impl_;
  for (int w = 0; w < im.opt.num_workers; ++w)
    im.receivers.emplace_back([&im, w] { im.receive_from(w); });
  im.refuser = std::thread([&im] { im.acceptor->refuse_until_stopped(); });
  auto last_snapshot = Clock::now();
  {
    std::unique_lock<std::mutex> lock(im.mutex);
    while (im.fatal.empty() && !im.everyone_left()) {
      im.changed.wait_for(lock, std::chrono::milliseconds(100));
      im.check_silent_workers();
      im.check_stalled_rounds();
      if (im.opt.snapshot_every_s > 0 &&
          Clock::now() - last_snapshot >= millis(im.opt.snapshot_every_s)) {
        try {
          im.take_snapshot_locked();
        } catch (const std::exception& e) {  // keep serving; the previous snapshot stays
          std::cerr << im.tag() << "periodic snapshot failed: " << e.what() << std::endl;
        }
        last_snapshot = Clock::now();
      }
    }
  }
  im.acceptor->stop();
  im.refuser.join();
  // Deliver what is queued (error messages included), then stop receiving.
  for (auto& c : im.channels) c->drain(std::chrono::seconds(5));
  for (auto& c : im.channels) c->close();
  for (auto& t : im.receivers) t.join();
  im.receivers.clear();
  for (auto& c : im.channels) c->disconnect();
  std::lock_guard<std::mutex> lock(im.mutex);
  if (!im.fatal.empty()) throw Error(im.fatal_code, im.fatal);
}

void Server::snapshot() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  HEMIOLA_CHECK(!impl_->opt.snapshot_path.empty(), "no snapshot path configured");
  impl_->take_snapshot_locked();
}

ServerStats Server::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats;
}

}  // namespace hemiola::ps
