// The worker side of the parameter server. Calls come from the training
// thread (and autograd hooks); one receive thread per server connection
// handles replies. Pulled values land in client-owned staging buffers and are
// copied into the caller's tensor only in wait_pull, so a reply never writes
// memory that a running forward or backward may be reading.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "hemiola/ps.h"
#include "hemiola/status.h"
#include "ps/channel.h"
#include "ps/connect.h"
#include "ps/optimizer.h"
#include "ps/protocol.h"
#include "ps/table.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxRecords = 4096;

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

// The header carries no maximize or amsgrad: the servers step without them.
void check_server_steps(const OptimizerHyper& h) {
  HEMIOLA_CHECK(!h.maximize && !h.amsgrad,
                "the parameter server steps without maximize and amsgrad; got maximize=",
                h.maximize, ", amsgrad=", h.amsgrad);
}

}  // namespace

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

  // Waits (lock held) until `done`, a failure, or the timeout; `what` names the wait.
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred done, const std::string& what) {
    const auto deadline = Clock::now() + timeout();
    while (!done()) {
      throw_if_failed();
      check_silent_servers();
      changed.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::seconds(1)));
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
  void check_silent_servers() {
    for (int s = 0; s < opt.num_servers; ++s) {
      if (channels[static_cast<size_t>(s)]->silent_for() < timeout()) continue;
      set_failure(detail::concat(server_name(s), " sent nothing, not even a heartbeat, for ",
                                 opt.timeout_s, " s: its machine or network is gone"),
                  ErrorCode::kTimeout);
    }
  }

  void send(const Shard& shard, MessageType type, int64_t version, std::vector<char> payload,
            int tensor, int32_t flags = 0, int64_t aux = 0) {
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
  void send_on(int server, const Header& h, std::vector<char> payload) {
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

  void require_open() const {
    if (closing) HEMIOLA_THROW(ErrorCode::kInvalidArgument, "the parameter-server client of "
                               "worker ", opt.worker_index, " is closed");
  }

  void send_control(int server, MessageType type, std::vector<char> payload = {}) {
    Header h;
    h.type = static_cast<uint16_t>(type);
    h.worker = opt.worker_index;
    h.optimizer = static_cast<int32_t>(opt.optimizer);
    h.aux = static_cast<int64_t>(opt.consistency);  // checked by the server at registration
    send_on(server, h, std::move(payload));
  }

  void set_failure(const std::string& message, ErrorCode code) {
    if (failure.empty()) {
      failure = message;
      failure_code = code;
    }
    changed.notify_all();
  }

  void on_message(int s, const Header& h, const std::vector<char>& payload) {
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
    } else {
      return set_failure(detail::concat("unexpected ", message_type_name(h.type), " from ",
                                        server_name(s)),
                         ErrorCode::kInternal);
    }
    changed.notify_all();
  }

  // Server s's receive thread: hands its replies to on_message() until close().
  void receive_from(int s) {
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

  const std::vector<int32_t>& keys_of(int tensor) const {
    HEMIOLA_CHECK(tensor >= 0 && static_cast<size_t>(tensor) < keys_of_tensor.size(),
                  "tensor index ", tensor, " is outside [0, ", keys_of_tensor.size(), ")");
    return keys_of_tensor[static_cast<size_t>(tensor)];
  }

  void push(int tensor, const float* grad) {
    const auto& ids = keys_of(tensor);
    std::unique_lock<std::mutex> lock(mutex);
    require_open();
    throw_if_failed();
    for (int32_t id : ids) {
      const Shard& shard = shards[static_cast<size_t>(id)];
      auto& k = keys[static_cast<size_t>(id)];
      if (opt.consistency == Consistency::kBsp && k.unacked > 0) {
        // Only a tensor left unused (whose pull nobody waited for) can get
        // here: its previous round may still be open, and a push for the round
        // after it must not overtake it.
        wait(lock, [&] { return k.unacked == 0; },
             detail::concat("the previous bsp round of '", names[static_cast<size_t>(tensor)],
                            "' (key ", id, ")"));
      }
      std::vector<char> payload;
      MessageType type = MessageType::kPushNone;
      if (grad) {
        type = MessageType::kPush;
        payload.resize(static_cast<size_t>(shard.count) * sizeof(float));
        std::memcpy(payload.data(), grad + shard.begin, payload.size());
      }
      outstanding += 1;
      k.unacked += 1;
      int64_t version = k.used_version;
      if (opt.consistency == Consistency::kBsp) {
        // Every worker pushes every key once per round, so this push belongs to
        // the round after the last one pushed (min_next - 1), or to the version
        // taken last, whichever is newer; the next pull must wait for its end.
        // A push without a gradient names the round even when the tensor's
        // newest values were never taken (it was unused).
        const int64_t round = std::max({k.min_next, k.used_version, k.arrived_version});
        if (!grad) version = round;
        k.min_next = round + 1;
      }
      if (opt.consistency == Consistency::kEager && opt.local_correction) {
        // The value the gradient was computed on already held this worker's
        // previous push, which the server applied before this one arrives.
        if (k.corrected) version += 1;
        remember_own(k, tensor, grad ? grad + shard.begin : nullptr);
      }
      send(shard, type, version, std::move(payload), tensor);
    }
  }

  void remember_own(KeyState& k, int tensor, const float* grad) {
    k.pushes_since_request += 1;
    k.own_is_gradient = grad != nullptr;
    if (!grad) return;
    const auto n = k.staging.size();
    k.own.assign(grad, grad + n);
    k.own_hyper = hyper[static_cast<size_t>(tensor)];
    if (opt.optimizer == OptimizerKind::kSgd) return;
    const auto beta2 = static_cast<float>(k.own_hyper.beta2);
    if (k.own_sq.size() != n) k.own_sq.assign(n, 0.0f);
    for (size_t i = 0; i < n; ++i)
      k.own_sq[i] = beta2 * k.own_sq[i] + (1.0f - beta2) * grad[i] * grad[i];
    k.own_pushes += 1;
  }

  // Lock held. Applies to `dst` (a pulled value at `version`) the part of
  // this worker's newest push that is its own: the step its gradient alone
  // takes, at the weight (ps/optimizer.h) its previous push got. What the
  // servers' momentum or moments add is the other workers' (and the past's)
  // share.
  void correct_locally(const KeyState& k, int64_t version, float* dst) const {
    const OptimizerHyper& h = k.own_hyper;
    const PushWeight weight =
        push_weight(opt.staleness_rule, opt.momentum_rule, k.last_staleness, opt.num_workers);
    const auto wd = static_cast<float>(h.weight_decay);
    const auto n = k.own.size();
    if (opt.optimizer == OptimizerKind::kSgd) {
      // buf' = m * buf + (1 - dampening) * grad_scale * (g + wd * w), stepped
      // by lr: the own share is that times the second term (Nesterov steps
      // grad_scale * (g + wd * w) + m * buf', so 1 + m times).
      const SgdPush push = sgd_push(h, weight);
      const double m = push.momentum;
      const auto own = static_cast<float>(push.lr * push.grad_scale *
                                          (h.nesterov ? 1.0 + m * (1.0 - h.dampening)
                                                      : 1.0 - h.dampening));
      for (size_t i = 0; i < n; ++i) dst[i] -= own * (k.own[i] + wd * dst[i]);
      return;
    }
    const auto lr = static_cast<float>(h.lr * weight.factor);
    // Adam: the own share of m' is (1 - beta1) * g; the denominator comes
    // from this worker's own gradients, the servers' v being out of reach.
    const double step = static_cast<double>(version + 1);
    const auto m_scale = static_cast<float>((1.0 - h.beta1) / (1.0 - std::pow(h.beta1, step)));
    const auto v_scale = static_cast<float>(
        1.0 / (1.0 - std::pow(h.beta2, static_cast<double>(std::max<int64_t>(1, k.own_pushes)))));
    const auto eps = static_cast<float>(h.eps);
    const bool adamw = opt.optimizer == OptimizerKind::kAdamW;
    for (size_t i = 0; i < n; ++i) {
      const float g = adamw ? k.own[i] : k.own[i] + wd * dst[i];
      const float denom = std::sqrt(k.own_sq[i] * v_scale) + eps;
      if (adamw) dst[i] *= 1.0f - lr * wd;
      dst[i] -= lr * m_scale * g / denom;
    }
  }
};

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
  for (const auto& h : hyper) check_server_steps(h);
  HEMIOLA_CHECK(im.opt.worker_index == 0 ? initial.size() == im.numels.size() : initial.empty(),
                "worker 0 passes one initial pointer per tensor; other workers pass none");
  {
    std::unique_lock<std::mutex> lock(im.mutex);
    im.hyper = hyper;
    for (int s = 0; s < im.opt.num_servers; ++s) {
      const std::string table = make_table(im.shards, im.names, s, im.opt.optimizer);
      im.send_control(s, MessageType::kRegister, std::vector<char>(table.begin(), table.end()));
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
  check_server_steps(hyper);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->hyper[static_cast<size_t>(tensor)] = hyper;
}

void Client::push(int tensor, const float* grad) {
  HEMIOLA_CHECK(grad != nullptr, "push: null gradient (use push_none for an unused tensor)");
  impl_->push(tensor, grad);
}

void Client::push_none(int tensor) { impl_->push(tensor, nullptr); }

void Client::pull(int tensor, bool ahead) {
  auto& im = *impl_;
  const auto& ids = im.keys_of(tensor);
  std::lock_guard<std::mutex> lock(im.mutex);
  im.require_open();
  im.throw_if_failed();
  ahead = ahead && im.opt.consistency == Consistency::kEager && im.opt.local_correction;
  for (int32_t id : ids) {
    auto& k = im.keys[static_cast<size_t>(id)];
    k.requested += 1;
    k.pushes_since_request = 0;
    // The own push will be about as stale as its previous one was.
    im.send(im.shards[static_cast<size_t>(id)], MessageType::kPull, k.min_next, {}, -1,
            ahead ? kFlagAhead : 0, k.last_staleness);
  }
}

bool Client::pull_ready(int tensor) {
  auto& im = *impl_;
  const auto& ids = im.keys_of(tensor);
  std::lock_guard<std::mutex> lock(im.mutex);
  im.require_open();
  im.throw_if_failed();
  return std::all_of(ids.begin(), ids.end(), [&](int32_t id) {
    const auto& k = im.keys[static_cast<size_t>(id)];
    return k.arrived >= k.requested;
  });
}

double Client::wait_pull(int tensor, float* dst) {
  auto& im = *impl_;
  const auto& ids = im.keys_of(tensor);
  HEMIOLA_CHECK(dst != nullptr || ids.empty(), "wait_pull: null destination");
  std::unique_lock<std::mutex> lock(im.mutex);
  im.require_open();
  std::chrono::duration<double> blocked{0.0};
  for (int32_t id : ids) {
    auto& k = im.keys[static_cast<size_t>(id)];
    const auto& shard = im.shards[static_cast<size_t>(id)];
    if (k.arrived < k.requested) {
      const auto start = Clock::now();
      im.wait(lock, [&] { return k.arrived >= k.requested; },
              detail::concat("the pull of '", im.names[static_cast<size_t>(tensor)], "' (key ",
                             id, ") from ", im.server_name(shard.server)));
      blocked += Clock::now() - start;
    }
    std::memcpy(dst + shard.begin, k.staging.data(), k.staging.size() * sizeof(float));
    k.used_version = k.arrived_version;
    // Exactly one push since the request: the reply lacks just that one. (A
    // reply requested after every push, as in synchronize(), is exact.)
    k.corrected = im.opt.consistency == Consistency::kEager && im.opt.local_correction &&
                  k.pushes_since_request == 1 && k.own_is_gradient;
    if (k.corrected) im.correct_locally(k, k.used_version, dst + shard.begin);
  }
  return blocked.count();
}

int64_t Client::version(int tensor) const {
  const auto& ids = impl_->keys_of(tensor);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return ids.empty() ? 0 : impl_->keys[static_cast<size_t>(ids.front())].used_version;
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
