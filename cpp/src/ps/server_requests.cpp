// What each message from a worker does to the server's state (ps/server_impl.h):
// registration, initial values, pulls and pushes (bsp rounds or one
// asynchronous step each), snapshots on request, and goodbyes. Called by the
// worker's receive thread with the state's mutex held.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ps/server_impl.h"

namespace hemiola::ps {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// ---- one message -------------------------------------------------------------------

void Server::Impl::handle(int w, const Header& h, const std::vector<char>& payload) {
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
  if (h.rule < 0 || h.rule > static_cast<int32_t>(StalenessRule::kZhang) ||
      h.momentum_rule < 0 || h.momentum_rule > static_cast<int32_t>(MomentumRule::kRescaled))
    return reject(w, h, detail::concat("unknown staleness rule ", h.rule, " or momentum rule ",
                                       h.momentum_rule));

  switch (type) {
    case MessageType::kInit: return on_init(w, k, h, payload);
    case MessageType::kPull: return on_pull(w, k, h);
    case MessageType::kPush:
    case MessageType::kPushNone: return on_push(w, k, h, payload);
    default:
      return reject(w, h, "not a worker-to-server message");
  }
}

// The initial values of a key, from worker 0.
void Server::Impl::on_init(int w, Key& k, const Header& h, const std::vector<char>& payload) {
  const auto bytes = static_cast<size_t>(k.entry.shard.count) * sizeof(float);
  if (w != 0) return reject(w, h, "only worker 0 sends initial values");
  if (payload.size() != bytes)
    return reject(w, h, detail::concat("expected ", bytes, " bytes of initial values"));
  if (k.initialized) return;  // restored from a snapshot: the snapshot wins
  k.param.resize(static_cast<size_t>(k.entry.shard.count));
  std::memcpy(k.param.data(), payload.data(), bytes);
  k.initialized = true;
  return answer_pulls(k);
}

void Server::Impl::on_pull(int w, Key& k, const Header& h) {
  // An ahead pull's aux: the staleness of the requester's previous push,
  // which its next one is expected to have (push_weight clamps it).
  const bool ahead = opt.consistency == Consistency::kEager && (h.flags & kFlagAhead);
  // Each waiting pull will hold a copy of the key: a worker has one or two.
  if (static_cast<size_t>(std::count_if(k.waiting.begin(), k.waiting.end(), [w](const Waiting& p) {
        return p.worker == w;
      })) >= kMaxWaitingPulls)
    return reject(w, h, detail::concat("more than ", kMaxWaitingPulls, " pulls of '",
                                       k.entry.name, "' wait for an answer"));
  k.waiting.push_back({w, h.version, ahead, ahead ? weight_of(h, h.aux) : PushWeight{}});
  return answer_pulls(k);
}

// A gradient (kPush) or none this iteration (kPushNone) for a key.
void Server::Impl::on_push(int w, Key& k, const Header& h, const std::vector<char>& payload) {
  const auto bytes = static_cast<size_t>(k.entry.shard.count) * sizeof(float);
  const bool has_grad = h.type == static_cast<uint16_t>(MessageType::kPush);
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
    const Shard& shard = k.entry.shard;
    if (const auto bad = first_non_finite(grad, shard.count, shard.begin); !bad.empty()) {
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
  if (grad) {
    if (const auto bad = hyper_problem(optimizer, get_hyper(h)); !bad.empty()) {
      const std::string what = detail::concat(
          who(w), " pushed a gradient for parameter '", k.entry.name, "' with ", bad,
          ". It was not applied. Check the optimizer's param_groups (an LR scheduler or a "
          "script that sets the learning rate)");
      if (opt.consistency == Consistency::kBsp) {  // the round cannot complete without it
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

void Server::Impl::on_register(int w, const Header& h, const std::vector<char>& payload) {
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
  Registration registration;
  try {
    registration = parse_registration(std::string(payload.begin(), payload.end()));
  } catch (const Error& e) {
    return reject(w, h, e.what());
  }
  const std::string& text = registration.table;
  if (table.empty()) {
    std::vector<TableEntry> entries;
    try {
      entries = parse_table(text, &optimizer);
    } catch (const Error& e) {
      return reject(w, h, e.what());
    }
    table = text;
    add_keys(entries);
    bound_channels();
  } else if (const auto diff = first_difference(table, text); !diff.empty()) {
    return fail(detail::concat("the model of ", who(w), " differs from ",
                               restored ? "the restored snapshot's" : "the first registered",
                               " (server ", opt.server_index, "'s shard table, ", diff,
                               "). Every worker must wrap the same model with the same "
                               "optimizer type and partition size."),
                ErrorCode::kInvalidArgument);
  }
  if (!check_registered_hyper(w, registration.hyper)) return;
  workers[static_cast<size_t>(w)] = WorkerState::kRegistered;
  send(w, MessageType::kRegistered, -1, 0, restored ? 1 : 0);
}

bool Server::Impl::check_registered_hyper(int w, const std::map<int32_t, OptimizerHyper>& hyper) {
  for (const auto& [id, k] : keys) {
    const auto mine = hyper.find(id);
    if (mine == hyper.end()) {
      fail(detail::concat(who(w), " registered no optimizer settings for parameter '",
                          k.entry.name, "' (key ", id, ")"),
           ErrorCode::kInvalidArgument);
      return false;
    }
    if (const auto bad = hyper_problem(optimizer, mine->second); !bad.empty()) {
      fail(detail::concat(who(w), " registered parameter '", k.entry.name, "' with ", bad,
                          ". Check the optimizer's settings"),
           ErrorCode::kInvalidArgument);
      return false;
    }
    if (registered_hyper_from < 0) continue;
    const auto first = registered_hyper.find(id);
    if (const auto diff = hyper_mismatch(optimizer, mine->second, who(w), first->second,
                                         who(registered_hyper_from));
        !diff.empty()) {
      fail(detail::concat("the optimizer settings of parameter '", k.entry.name, "' differ: ",
                          diff, ". Every worker must give its optimizer the same settings "
                          "(bsp would average their gradients and step with one worker's)"),
           ErrorCode::kInvalidArgument);
      return false;
    }
  }
  if (hyper.size() != keys.size()) {
    fail(detail::concat(who(w), " registered optimizer settings for ", hyper.size(),
                        " keys; server ", opt.server_index, " holds ", keys.size()),
         ErrorCode::kInvalidArgument);
    return false;
  }
  if (registered_hyper_from < 0) {
    registered_hyper = hyper;
    registered_hyper_from = w;
  }
  return true;
}

// The keys of a table (the first registration's, or a restored snapshot's).
void Server::Impl::add_keys(const std::vector<TableEntry>& entries) {
  for (const auto& e : entries) {
    Key k;
    k.entry = e;
    k.optimizer.kind = optimizer;
    k.pushes.assign(static_cast<size_t>(opt.num_workers), 0);
    keys.emplace(e.shard.key, std::move(k));
  }
}

void Server::Impl::on_bye(int w) {
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

std::string Server::Impl::gone_workers() const {
  std::string names;
  for (int v = 0; v < opt.num_workers; ++v)
    if (workers[static_cast<size_t>(v)] == WorkerState::kGone)
      names += (names.empty() ? "" : ", ") + who(v);
  return names;
}

// ---- pulls -------------------------------------------------------------------------

bool Server::Impl::may_read(const Key& k, const Waiting& p) const {
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

void Server::Impl::answer_pulls(Key& k) {
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

void Server::Impl::answer_all_pulls() {
  for (auto& [id, k] : keys) answer_pulls(k);
}

// ---- pushes ------------------------------------------------------------------------

void Server::Impl::apply_bsp(int w, Key& k, const Header& h, const float* grad) {
  const auto n = static_cast<size_t>(k.entry.shard.count);
  if (k.contributions == 0) {
    k.sum.assign(n, 0.0f);
    k.contributed.assign(static_cast<size_t>(opt.num_workers), 0);
    k.any_gradient = false;
    k.round_started = Clock::now();
  }
  if (grad && k.any_gradient) {
    // One round steps once, with one setting: mixing two would apply neither.
    if (const auto diff = hyper_mismatch(optimizer, get_hyper(h), who(w), k.round_hyper,
                                         who(k.round_hyper_from));
        !diff.empty()) {
      stats.rejected += 1;
      return fail(detail::concat("bsp round ", k.version, " of '", k.entry.name,
                                 "' got gradients stepped with different optimizer settings: ",
                                 diff, ". Every worker must use the same settings (the same "
                                 "learning-rate schedule, stepped as often)"),
                  ErrorCode::kInvalidArgument);
    }
  }
  k.contributed[static_cast<size_t>(w)] = grad ? 1 : 2;
  k.contributions += 1;
  if (grad) {
    for (size_t i = 0; i < n; ++i) k.sum[i] += grad[i];
    if (!k.any_gradient) {
      k.round_hyper = get_hyper(h);
      k.round_hyper_from = w;
    }
    k.any_gradient = true;
  }
  if (k.contributions < opt.num_workers) return;
  // The round is complete: the averaged gradient steps once, as all-reduce would.
  const int64_t applied_at = k.version;
  k.contributions = 0;
  if (k.any_gradient) {
    const float scale = 1.0f / static_cast<float>(opt.num_workers);
    for (auto& g : k.sum) g *= scale;
    try {
      optimizer_step(k.optimizer, k.param.data(), k.sum.data(), k.entry.shard.count,
                     k.round_hyper, PushWeight{});
    } catch (const std::exception& e) {  // never a round left half applied and waiting
      return fail(detail::concat("bsp round ", applied_at, " of '", k.entry.name,
                                 "' could not step: ", e.what()),
                  ErrorCode::kInvalidArgument);
    }
    if (failed_on_non_finite_step(k, k.round_hyper, "every worker")) return;
  }
  k.version += 1;
  stats.pushes_applied += opt.num_workers;
  for (int v = 0; v < opt.num_workers; ++v)
    send(v, MessageType::kPushAck, k.entry.shard.key, applied_at, applied_at, {}, 1.0,
         k.contributed[static_cast<size_t>(v)] == 2 ? kFlagNoGradient : 0);
  answer_pulls(k);
}

bool Server::Impl::failed_on_non_finite_step(const Key& k, const OptimizerHyper& hyper,
                                             const std::string& who_stepped) {
  if (!opt.check_finite) return false;
  const auto bad = first_non_finite(k.param.data(), k.entry.shard.count, k.entry.shard.begin);
  if (bad.empty()) return false;
  fail(detail::concat("a step of parameter '", k.entry.name, "' at version ", k.version,
                      " with the settings of ", who_stepped, " (lr ", hyper.lr,
                      ") made it non-finite (", bad, "). The servers' parameters are lost: "
                      "restart from a snapshot with a smaller learning rate "
                      "(check_finite=False turns this check off)"),
       ErrorCode::kInvalidArgument);
  return true;
}

// A push `tau` versions stale, by the staleness and momentum rules its
// worker declares (checked to be known when the message arrived).
PushWeight Server::Impl::weight_of(const Header& h, int64_t tau) const {
  return push_weight(static_cast<StalenessRule>(h.rule),
                     static_cast<MomentumRule>(h.momentum_rule), tau, opt.num_workers);
}

void Server::Impl::apply_async(int w, Key& k, const Header& h, const float* grad) {
  const PushWeight weight = weight_of(h, k.version - h.version);
  const int64_t applied_at = k.version;
  if (grad) {
    k.hyper = get_hyper(h);
    try {
      optimizer_step(k.optimizer, k.param.data(), grad, k.entry.shard.count, *k.hyper, weight);
    } catch (const std::exception& e) {
      return reject(w, h, detail::concat("the step failed: ", e.what()));
    }
    if (failed_on_non_finite_step(k, *k.hyper, who(w))) return;
    k.version += 1;
  }
  k.pushes[static_cast<size_t>(w)] += 1;
  stats.pushes_applied += 1;
  send(w, MessageType::kPushAck, k.entry.shard.key, h.version, applied_at, {}, weight.factor,
       grad ? 0 : kFlagNoGradient);
  answer_pulls(k);  // the ssp bound is per key: only this key's waiters can move
}

}  // namespace hemiola::ps
