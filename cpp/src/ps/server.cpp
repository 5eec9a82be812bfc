// The parameter server's lifecycle: admitting the workers, one receive thread
// per worker connection (ps/channel.h's receive_loop, handing each message to
// Impl::handle in ps/server_requests.cpp under one mutex), replies through
// each channel's own sender thread, so a receive loop never blocks on the
// network, and snapshots. serve()'s thread is the watchdog: it ends the run
// when every worker has left, fails a bsp run whose round waits too long, and
// takes periodic snapshots.
#include <algorithm>
#include <chrono>
#include <iostream>

#include "ps/address.h"
#include "ps/server_impl.h"
#include "ps/snapshot.h"

namespace hemiola::ps {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

// ---- replies and failures ----------------------------------------------------------

void Server::Impl::send(int w, MessageType type, int32_t key, int64_t version, int64_t aux,
                        std::vector<char> payload, double factor, int32_t flags) {
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
void Server::Impl::send_error(int w, const std::string& message, ErrorCode code) {
  send(w, MessageType::kError, -1, 0, static_cast<int64_t>(code),
       std::vector<char>(message.begin(), message.end()));
}

// Kept for stats(); printed by the caller.
void Server::Impl::keep(const std::string& message) {
  stats.rejections.push_back(message);
  if (stats.rejections.size() > 32) stats.rejections.erase(stats.rejections.begin());
}

void Server::Impl::remember(const std::string& message) {
  keep(message);
  std::cerr << tag() << message << std::endl;
}

void Server::Impl::reject(int w, const Header& h, const std::string& why) {
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
void Server::Impl::refused(const std::string& why) {
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

void Server::Impl::fail(const std::string& message, ErrorCode code) {
  if (!fatal.empty()) return;
  fatal = message;
  fatal_code = code;
  std::cerr << tag() << message << std::endl;
  for (int w = 0; w < opt.num_workers; ++w) send_error(w, message, code);
  changed.notify_all();
}

void Server::Impl::on_disconnect(int w, const std::string& what) {
  auto& state = workers[static_cast<size_t>(w)];
  if (state == WorkerState::kGone) return;  // said goodbye first: a normal exit
  if (state == WorkerState::kDead) return;  // already declared (silent, then the socket)
  state = WorkerState::kDead;
  stats.dead_workers.push_back(w);
  keep(detail::concat(who(w), " disconnected: ", what));
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

// ---- the send queues ---------------------------------------------------------------

size_t Server::Impl::queue_limit() const {
  size_t shard_bytes = 0;
  for (const auto& [id, k] : keys)
    shard_bytes += static_cast<size_t>(k.entry.shard.count) * sizeof(float);
  return kQueueFloorBytes + kQueueShardCopies * shard_bytes;
}

size_t Server::Impl::payload_limit() const {
  size_t largest_shard = 0;
  for (const auto& [id, k] : keys) {
    largest_shard =
        std::max(largest_shard, static_cast<size_t>(k.entry.shard.count) * sizeof(float));
  }
  const size_t registration =
      table.empty() ? kRegistrationFloorBytes
                    : table.size() + keys.size() * kSettingsLineBytes + kRegistrationSlackBytes;
  return std::max(largest_shard, registration);
}

void Server::Impl::bound_channels() {
  const size_t queue = queue_limit(), payload = payload_limit();
  for (auto& c : channels) {
    c->set_queue_limit(queue);
    c->set_payload_limit(payload);
  }
}

// ---- snapshots ---------------------------------------------------------------------

void Server::Impl::take_snapshot_locked() {
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

void Server::Impl::restore() {
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

// ---- the receive threads ----------------------------------------------------------

void Server::Impl::receive_from(int w) {
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
      [this, w](const std::string& why) {
        on_disconnect(w, why);
        // A worker dropped for not reading its replies: close its socket now
        // (its sender has stopped), so the kernel frees what it holds for it.
        auto& channel = *channels[static_cast<size_t>(w)];
        if (channel.overflowed()) channel.disconnect();
      });
}

// ---- the watchdog ------------------------------------------------------------------

bool Server::Impl::everyone_left() const {
  return std::none_of(workers.begin(), workers.end(), [](WorkerState s) {
    return s == WorkerState::kConnected || s == WorkerState::kRegistered;
  });
}

// A worker whose connection neither closed nor carried anything (not even
// its channel's pings) for timeout_s is gone: its machine or network vanished.
void Server::Impl::check_silent_workers() {
  for (int w = 0; w < opt.num_workers; ++w) {
    if (!live(w)) continue;
    const auto silent = channels[static_cast<size_t>(w)]->silent_for();
    if (silent < millis(opt.timeout_s)) continue;
    on_disconnect(w, detail::concat("nothing heard from it, not even a heartbeat, for ",
                                    opt.timeout_s, " s: its machine or network is gone"));
  }
}

void Server::Impl::excuse_pause(std::chrono::steady_clock::duration gap) {
  for (auto& channel : channels) channel->excuse(gap);
  for (auto& [id, k] : keys) k.round_started += gap;
  std::cerr << tag() << "did not run for "
            << std::chrono::duration_cast<std::chrono::milliseconds>(gap).count() / 1000.0
            << " s (the process was paused or starved of CPU); no worker is blamed for that time"
            << std::endl;
}

void Server::Impl::check_stalled_rounds() {
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

// ---- lifecycle ---------------------------------------------------------------------

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
  im.bound_channels();  // the restored keys', else the floors until the first registration
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
    auto last_tick = Clock::now();
    while (im.fatal.empty() && !im.everyone_left()) {
      im.changed.wait_for(lock, std::chrono::milliseconds(100));
      // The watchdog wakes every 100 ms: a longer gap is time the server
      // itself did not run (SIGSTOP, a starved machine), in which the
      // workers' messages queued unread. Blaming them for it named healthy
      // workers as dead (2 of 6 pauses).
      const auto now = Clock::now();
      if (now - last_tick > kPauseGap) im.excuse_pause(now - last_tick);
      last_tick = now;
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
