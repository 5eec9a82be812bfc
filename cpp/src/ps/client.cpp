// The worker side of the parameter server: its connections. Calls come from
// the training thread (and autograd hooks); one receive thread per server
// connection (ps/channel.h's receive_loop) hands replies to on_message, which
// updates the state that pushes and pulls (ps/client_push_pull.cpp) wait on.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "ps/client_impl.h"
#include "ps/connect.h"
#include "ps/table.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxRecords = 4096;

// The header carries no maximize or amsgrad: the servers step without them.
// A setting the servers would refuse is refused here first, where the
// script that set it runs.
void check_server_steps(OptimizerKind kind, const std::string& name, const OptimizerHyper& h) {
  HEMIOLA_CHECK(!h.maximize && !h.amsgrad,
                "the parameter server steps without maximize and amsgrad; got maximize=",
                h.maximize, ", amsgrad=", h.amsgrad);
  if (const auto bad = hyper_problem(kind, h); !bad.empty())
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "parameter '", name, "' would step with ", bad,
                  ": the servers refuse it. Check the optimizer's param_groups (an LR "
                  "scheduler or a script that sets the learning rate)");
}

}  // namespace

// ---- failures and waiting ----------------------------------------------------------

void Client::Impl::set_failure(const std::string& message, ErrorCode code) {
  if (failure.empty()) {
    failure = message;
    failure_code = code;
  }
  changed.notify_all();
}

void Client::Impl::wait(std::unique_lock<std::mutex>& lock, const std::function<bool()>& done,
                        const std::string& what) {
  auto deadline = Clock::now() + timeout();
  while (!done()) {
    throw_if_failed();
    check_silent_servers();
    const auto asked = std::min(deadline, Clock::now() + std::chrono::seconds(1));
    changed.wait_until(lock, asked);
    // Woken far later than asked: this worker did not run (paused, starved);
    // the servers' messages queued unread meanwhile, and the wait's own
    // deadline is not theirs to have missed.
    const auto late = Clock::now() - asked;
    if (late > kPauseGap) {
      for (auto& channel : channels) channel->excuse(late);
      deadline += late;
    }
    if (!done() && Clock::now() >= deadline) {
      throw_if_failed();
      HEMIOLA_THROW(ErrorCode::kTimeout, "worker ", opt.worker_index, ": ", what,
                    " did not complete within ", opt.timeout_s,
                    " s (a server or another worker died or stalled)");
    }
  }
  throw_if_failed();
}

// A server that sent nothing, not even a heartbeat, for timeout_s is gone.
void Client::Impl::check_silent_servers() {
  for (int s = 0; s < opt.num_servers; ++s) {
    if (channels[static_cast<size_t>(s)]->silent_for() < timeout()) continue;
    set_failure(detail::concat(server_name(s), " sent nothing, not even a heartbeat, for ",
                               opt.timeout_s, " s: its machine or network is gone"),
                ErrorCode::kTimeout);
  }
}

// ---- messages out ------------------------------------------------------------------

void Client::Impl::send(const Shard& shard, MessageType type, int64_t version,
                        std::vector<char> payload, int tensor, int32_t flags, int64_t aux) {
  Header h;
  h.flags = flags;
  h.momentum_rule = static_cast<int32_t>(opt.momentum_rule);
  h.aux = aux;
  h.type = static_cast<uint16_t>(type);
  h.key = shard.key;
  h.worker = opt.worker_index;
  h.version = version;
  h.rule = static_cast<int32_t>(opt.staleness_rule);
  h.optimizer = static_cast<int32_t>(opt.optimizer);
  if (tensor >= 0) put_hyper(h, hyper[static_cast<size_t>(tensor)]);
  send_on(shard.server, h, std::move(payload));
}

// Lock held. A send that cannot be queued means the connection failed: the
// job cannot go on, so that becomes this worker's failure, not a silent drop.
void Client::Impl::send_on(int server, const Header& h, std::vector<char> payload) {
  auto& channel = *channels[static_cast<size_t>(server)];
  if (!channel.send(h, std::move(payload))) {
    const std::string why = channel.send_failure();
    set_failure(why.empty() ? detail::concat("the connection to ", server_name(server),
                                             " is closed")
                            : why,
                ErrorCode::kCommFailure);
    throw_if_failed();
  }
}

void Client::Impl::send_control(int server, MessageType type, std::vector<char> payload) {
  Header h;
  h.type = static_cast<uint16_t>(type);
  h.worker = opt.worker_index;
  h.optimizer = static_cast<int32_t>(opt.optimizer);
  h.aux = static_cast<int64_t>(opt.consistency);  // checked by the server at registration
  send_on(server, h, std::move(payload));
}

// ---- messages in -------------------------------------------------------------------

void Client::Impl::on_message(int s, const Header& h, const std::vector<char>& payload) {
  if (const auto problem = header_problem(h); !problem.empty())
    return set_failure(detail::concat("malformed message from ", server_name(s), ": ", problem),
                       ErrorCode::kCommFailure);
  auto& expected = expected_seq[static_cast<size_t>(s)];
  if (h.seq != expected)
    return set_failure(detail::concat("out-of-order message from ", server_name(s),
                                      ": sequence number ", h.seq, ", expected ", expected),
                       ErrorCode::kCommFailure);
  expected += 1;
  const auto type = static_cast<MessageType>(h.type);
  if (type == MessageType::kError) {
    return set_failure(std::string(payload.begin(), payload.end()),
                       static_cast<ErrorCode>(h.aux));
  }
  if (type == MessageType::kRegistered) {
    registered += 1;
  } else if (type == MessageType::kSnapshotDone) {
    snapshots_done += 1;
  } else if (h.key < 0 || static_cast<size_t>(h.key) >= shards.size() ||
             shards[static_cast<size_t>(h.key)].server != s) {
    return set_failure(detail::concat(server_name(s), " answered for key ", h.key,
                                      ", which it does not hold"),
                       ErrorCode::kInternal);
  } else if (type == MessageType::kPullReply) {
    auto& k = keys[static_cast<size_t>(h.key)];
    if (payload.size() != k.staging.size() * sizeof(float))
      return set_failure(detail::concat(server_name(s), " sent ", payload.size(),
                                        " bytes for key ", h.key),
                         ErrorCode::kInternal);
    std::memcpy(k.staging.data(), payload.data(), payload.size());
    k.arrived += 1;
    k.arrived_version = h.version;
  } else if (type == MessageType::kPushAck) {
    on_push_ack(h);
  } else {
    return set_failure(detail::concat("unexpected ", message_type_name(h.type), " from ",
                                      server_name(s)),
                       ErrorCode::kInternal);
  }
  changed.notify_all();
}

// A push was applied: its staleness goes into the records and the summary.
void Client::Impl::on_push_ack(const Header& h) {
  outstanding -= 1;
  keys[static_cast<size_t>(h.key)].unacked -= 1;
  if (!(h.flags & kFlagNoGradient)) {  // a push without gradient has no staleness
    keys[static_cast<size_t>(h.key)].last_staleness = h.aux - h.version;
    const auto& shard = shards[static_cast<size_t>(h.key)];
    const PushRecord r{shard.tensor, shard.key, h.version, h.aux, h.aux - h.version,
                       h.factor};
    records.push_back(r);
    if (records.size() > kMaxRecords) records.pop_front();
    summary.pushes += 1;
    summary.staleness_sum += r.staleness;
    summary.max_staleness = std::max(summary.max_staleness, r.staleness);
    summary.lr_factor_sum += r.lr_factor;
    summary.histogram[r.staleness] += 1;
  }
}

void Client::Impl::receive_from(int s) {
  receive_loop(
      *channels[static_cast<size_t>(s)], mutex,
      [this, s](const Header& h, const std::vector<char>& payload) {
        on_message(s, h, payload);
        return true;
      },
      [this, s](const std::string& why) {
        if (!closed)
          set_failure(detail::concat(server_name(s), " is unreachable: ", why,
                                     ". The server died; restart the job, with its snapshot "
                                     "if it wrote one."),
                      ErrorCode::kCommFailure);
      });
}

// ---- the public interface ----------------------------------------------------------

Client::Client(const ClientOptions& options, const std::vector<std::string>& names,
               const std::vector<int64_t>& numels, std::shared_ptr<Store> store)
    : impl_(std::make_unique<Impl>()) {
  auto& im = *impl_;
  HEMIOLA_CHECK(store, "a store is required");
  HEMIOLA_CHECK(names.size() == numels.size(), "names and numels differ in length");
  HEMIOLA_CHECK(options.num_workers >= 1 && options.worker_index >= 0 &&
                    options.worker_index < options.num_workers,
                "worker index ", options.worker_index, " is outside [0, ", options.num_workers, ")");
  HEMIOLA_CHECK(options.timeout_s > 0, "timeout_s must be positive");
  im.opt = options;
  im.names = names;
  im.numels = numels;
  im.store = std::move(store);
  im.shards = plan_shards(numels, options.num_servers, options.partition_elems);
  im.keys_of_tensor.resize(numels.size());
  im.keys.resize(im.shards.size());
  for (const auto& s : im.shards) {
    im.keys_of_tensor[static_cast<size_t>(s.tensor)].push_back(s.key);
    im.keys[static_cast<size_t>(s.key)].staging.resize(static_cast<size_t>(s.count));
  }
  im.hyper.resize(numels.size());
  im.expected_seq.assign(static_cast<size_t>(options.num_servers), 0);

  for (int s = 0; s < options.num_servers; ++s) {
    Socket socket = connect_to_server(*im.store, s, options.worker_index, options.token,
                                      im.timeout(), im.server_name(s));
    im.channels.push_back(std::make_unique<Channel>(std::move(socket), im.server_name(s),
                                                    im.timeout(),
                                                    heartbeat_for(options.timeout_s)));
  }
  for (int s = 0; s < options.num_servers; ++s)
    im.receivers.emplace_back([&im, s] { im.receive_from(s); });
}

Client::~Client() {
  try {
    close();
  } catch (...) {  // a destructor must not throw; close() already reported through failure
  }
}

const std::vector<Shard>& Client::shards() const { return impl_->shards; }

void Client::initialize(const std::vector<const float*>& initial,
                        const std::vector<OptimizerHyper>& hyper) {
  auto& im = *impl_;
  HEMIOLA_CHECK(hyper.size() == im.numels.size(),
                "one set of hyper-parameters per tensor expected, got ", hyper.size());
  for (size_t t = 0; t < hyper.size(); ++t)
    check_server_steps(im.opt.optimizer, im.names[t], hyper[t]);
  HEMIOLA_CHECK(im.opt.worker_index == 0 ? initial.size() == im.numels.size() : initial.empty(),
                "worker 0 passes one initial pointer per tensor; other workers pass none");
  {
    std::unique_lock<std::mutex> lock(im.mutex);
    im.hyper = hyper;
    for (int s = 0; s < im.opt.num_servers; ++s) {
      std::map<int32_t, OptimizerHyper> settings;  // of this server's keys
      for (const auto& shard : im.shards)
        if (shard.server == s) settings[shard.key] = hyper[static_cast<size_t>(shard.tensor)];
      const std::string text =
          make_registration(make_table(im.shards, im.names, s, im.opt.optimizer), settings);
      im.send_control(s, MessageType::kRegister, std::vector<char>(text.begin(), text.end()));
    }
    im.wait(lock, [&] { return im.registered == im.opt.num_servers; }, "registration");
    if (im.opt.worker_index == 0) {
      for (const auto& shard : im.shards) {
        std::vector<char> payload(static_cast<size_t>(shard.count) * sizeof(float));
        std::memcpy(payload.data(), initial[static_cast<size_t>(shard.tensor)] + shard.begin,
                    payload.size());
        im.send(shard, MessageType::kInit, 0, std::move(payload), shard.tensor);
      }
    }
  }
  for (size_t t = 0; t < im.numels.size(); ++t) pull(static_cast<int>(t));
}

void Client::set_hyper(int tensor, const OptimizerHyper& hyper) {
  impl_->keys_of(tensor);  // range check
  check_server_steps(impl_->opt.optimizer, impl_->names[static_cast<size_t>(tensor)], hyper);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->hyper[static_cast<size_t>(tensor)] = hyper;
}

void Client::flush() {
  auto& im = *impl_;
  std::unique_lock<std::mutex> lock(im.mutex);
  im.wait(lock, [&] { return im.outstanding == 0; },
          detail::concat("acknowledging ", im.outstanding, " pushes"));
}

void Client::snapshot() {
  auto& im = *impl_;
  std::unique_lock<std::mutex> lock(im.mutex);
  im.require_open();
  im.throw_if_failed();
  const int target = im.snapshots_done + im.opt.num_servers;
  for (int s = 0; s < im.opt.num_servers; ++s) im.send_control(s, MessageType::kSnapshot);
  im.wait(lock, [&] { return im.snapshots_done >= target; }, "the servers' snapshots");
}

std::vector<PushRecord> Client::push_records() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return {impl_->records.begin(), impl_->records.end()};
}

StalenessSummary Client::staleness() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->summary;
}

void Client::close() {
  auto& im = *impl_;
  {
    std::lock_guard<std::mutex> lock(im.mutex);
    if (im.closing) return;
    im.closing = true;  // concurrent or later calls return at once
  }
  // Pushes in flight are part of the training: wait for them, then say goodbye.
  // If that fails, leave without a goodbye: the servers then see this worker
  // as dead, which is what it is to a bsp job.
  std::string error;
  try {
    flush();
  } catch (const std::exception& e) {
    error = e.what();
  }
  {
    std::lock_guard<std::mutex> lock(im.mutex);
    im.closed = true;
    if (error.empty()) {
      for (int s = 0; s < im.opt.num_servers; ++s) {
        Header h;
        h.type = static_cast<uint16_t>(MessageType::kBye);
        h.worker = im.opt.worker_index;
        im.channels[static_cast<size_t>(s)]->send(h);
      }
    }
  }
  for (auto& c : im.channels) c->drain(std::chrono::seconds(5));
  for (auto& c : im.channels) c->close();
  for (auto& t : im.receivers)
    if (t.joinable()) t.join();
  for (auto& c : im.channels) c->disconnect();
  if (!error.empty()) {
    std::lock_guard<std::mutex> lock(im.mutex);
    throw Error(im.failure.empty() ? ErrorCode::kTimeout : im.failure_code, error);
  }
}

}  // namespace hemiola::ps
