// The worker side of the parameter server: pushes and pulls. Pulled values
// land in client-owned staging buffers (filled by the receive threads, see
// ps/client.cpp) and are copied into the caller's tensor only in wait_pull, so
// a reply never writes memory that a running forward or backward may be
// reading. Under eager with local correction, wait_pull also applies the
// worker's own newest push, which the reply cannot contain yet.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "ps/client_impl.h"

namespace hemiola::ps {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

const std::vector<int32_t>& Client::Impl::keys_of(int tensor) const {
  HEMIOLA_CHECK(tensor >= 0 && static_cast<size_t>(tensor) < keys_of_tensor.size(),
                "tensor index ", tensor, " is outside [0, ", keys_of_tensor.size(), ")");
  return keys_of_tensor[static_cast<size_t>(tensor)];
}

void Client::Impl::push(int tensor, const float* grad) {
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

void Client::Impl::remember_own(KeyState& k, int tensor, const float* grad) {
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
void Client::Impl::correct_locally(const KeyState& k, int64_t version, float* dst) const {
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

// ---- the public interface ----------------------------------------------------------

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

}  // namespace hemiola::ps
