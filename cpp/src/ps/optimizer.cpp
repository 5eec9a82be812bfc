// The parameter server's optimizer: the engine's own (hemiola/optimizer.h),
// committing in place on the server's float32 shards.
#include "ps/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "hemiola/optimizer.h"
#include "hemiola/status.h"

namespace hemiola::ps {

namespace {

// The shortest of %.6g and %.17g that reads back as `v`: 0.05, not
// 0.050000000000000003, but two values that differ never print alike.
std::string format_value(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", v);
  if (std::strtod(text, nullptr) != v && !std::isnan(v)) std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

// The settings `kind` steps with, by torch.optim's names.
std::vector<std::pair<const char*, double>> settings(OptimizerKind kind, const OptimizerHyper& h) {
  if (kind == OptimizerKind::kSgd)
    return {{"lr", h.lr}, {"momentum", h.momentum}, {"dampening", h.dampening},
            {"weight_decay", h.weight_decay}, {"nesterov", h.nesterov ? 1.0 : 0.0}};
  return {{"lr", h.lr}, {"beta1", h.beta1}, {"beta2", h.beta2}, {"eps", h.eps},
          {"weight_decay", h.weight_decay}};
}

}  // namespace

PushWeight push_weight(StalenessRule rule, MomentumRule momentum_rule, int64_t tau,
                       int num_workers) {
  tau = std::max<int64_t>(0, tau);
  const double f = staleness_factor(rule, tau);
  PushWeight w;
  w.factor = f;
  switch (momentum_rule) {
    case MomentumRule::kNone:
      w.lr_scale = f;
      break;
    case MomentumRule::kCompensated:
      w.grad_scale = f;
      w.momentum_scale = 1.0 / (1.0 + static_cast<double>(tau));
      break;
    case MomentumRule::kRescaled:
      // A round's other N - 1 pushes are the staleness bsp itself has.
      w.grad_scale = std::min(1.0, static_cast<double>(std::max(1, num_workers)) * f);
      w.rescale_workers = std::max(1, num_workers);
      break;
  }
  return w;
}

SgdPush sgd_push(const OptimizerHyper& hyper, const PushWeight& weight) {
  SgdPush p;
  p.lr = hyper.lr * weight.lr_scale;
  p.momentum = hyper.momentum * weight.momentum_scale;
  p.grad_scale = weight.grad_scale;
  if (weight.rescale_workers > 1) {
    const double n = weight.rescale_workers;
    const double m = hyper.momentum;
    p.momentum = m > 0.0 ? std::pow(m, 1.0 / n) : 0.0;
    // (1 - m^(1/n)) / (n (1 - m)): 1/n without momentum, 1/n^2 in the limit m -> 1.
    p.grad_scale *= m <= 0.0 ? 1.0 / n : m >= 1.0 ? 1.0 / (n * n)
                                                  : (1.0 - p.momentum) / (n * (1.0 - m));
  }
  return p;
}

void optimizer_step(OptimizerState& state, float* param, const float* grad, int64_t n,
                    const OptimizerHyper& hyper, const PushWeight& weight) {
  const Device cpu{};
  if (state.kind == OptimizerKind::kSgd) {
    // grad_scale * (grad + weight_decay * param) as it enters the buffer.
    const SgdPush push = sgd_push(hyper, weight);
    SgdHyper h{hyper};
    h.lr = push.lr;
    h.momentum = push.momentum;
    h.grad_scale = push.grad_scale;
    h.weight_decay = hyper.weight_decay * push.grad_scale;
    h.first_step = hyper.momentum != 0.0 && !state.has_momentum;
    if (h.first_step) state.m.assign(static_cast<size_t>(n), 0.0f);
    sgd_step(SgdTensors{param, param, state.m.data(), grad}, n, DType::kFloat32, cpu, h, true);
    if (hyper.momentum != 0.0) state.has_momentum = true;
    return;
  }
  HEMIOLA_CHECK(state.kind == OptimizerKind::kAdam || state.kind == OptimizerKind::kAdamW,
                "unknown optimizer kind ", static_cast<int>(state.kind));
  if (state.m.size() != static_cast<size_t>(n)) {
    state.m.assign(static_cast<size_t>(n), 0.0f);
    state.v.assign(static_cast<size_t>(n), 0.0f);
  }
  AdamHyper h{hyper};
  h.lr = hyper.lr * weight.factor;
  h.decoupled_weight_decay = state.kind == OptimizerKind::kAdamW;
  h.step = ++state.step;
  adam_step(AdamTensors{param, param, state.m.data(), state.v.data(), grad}, n, DType::kFloat32,
            cpu, h, true);
}

void momentum_share_removed(const OptimizerState& state, const float* param, float* out,
                            int64_t n, const OptimizerHyper& hyper, const PushWeight& weight) {
  // One pass over the shard either way: this runs for every eager pull.
  if (state.kind == OptimizerKind::kSgd) {
    if (!state.has_momentum || hyper.momentum == 0.0) {
      std::copy(param, param + n, out);
      return;
    }
    const SgdPush push = sgd_push(hyper, weight);
    const double mu = push.momentum;
    const auto scale = static_cast<float>(push.lr * mu * (hyper.nesterov ? mu : 1.0));
    for (int64_t i = 0; i < n; ++i) out[i] = param[i] - scale * state.m[static_cast<size_t>(i)];
    return;
  }
  if (state.step == 0 || state.m.size() != static_cast<size_t>(n)) {
    std::copy(param, param + n, out);
    return;
  }
  const auto t = static_cast<double>(state.step + 1);
  const double lr = hyper.lr * weight.factor;
  const auto a = static_cast<float>(lr * hyper.beta1 / (1.0 - std::pow(hyper.beta1, t)));
  const auto b = static_cast<float>(hyper.beta2 / (1.0 - std::pow(hyper.beta2, t)));
  const auto eps = static_cast<float>(hyper.eps);
  for (int64_t i = 0; i < n; ++i) {
    const auto j = static_cast<size_t>(i);
    out[i] = param[i] - a * state.m[j] / (std::sqrt(b * state.v[j]) + eps);
  }
}

std::string hyper_problem(OptimizerKind kind, const OptimizerHyper& h) {
  for (const auto& [name, value] : settings(kind, h))
    if (!std::isfinite(value)) return detail::concat("a non-finite ", name, " (", value, ")");
  const auto invalid = [](const char* what, const char* name, double value) {
    return detail::concat("an invalid ", what, " (", name, " ", format_value(value), ")");
  };
  if (h.lr < 0.0) return invalid("learning rate", "lr", h.lr);
  if (h.weight_decay < 0.0) return invalid("weight decay", "weight_decay", h.weight_decay);
  if (kind == OptimizerKind::kSgd) {
    if (h.momentum < 0.0) return invalid("momentum", "momentum", h.momentum);
    if (h.nesterov && (h.momentum <= 0.0 || h.dampening != 0.0))
      return "nesterov without momentum or with dampening (torch.optim.SGD refuses it too)";
    return {};
  }
  if (h.eps < 0.0) return invalid("epsilon", "eps", h.eps);
  if (h.beta1 < 0.0 || h.beta1 >= 1.0) return invalid("beta1, outside [0, 1)", "beta1", h.beta1);
  if (h.beta2 < 0.0 || h.beta2 >= 1.0) return invalid("beta2, outside [0, 1)", "beta2", h.beta2);
  return {};
}

std::string hyper_mismatch(OptimizerKind kind, const OptimizerHyper& a, const std::string& who_a,
                           const OptimizerHyper& b, const std::string& who_b) {
  const auto sa = settings(kind, a), sb = settings(kind, b);
  std::string mine, theirs;
  for (size_t i = 0; i < sa.size(); ++i) {
    // Bitwise, NaN included: the same setting steps alike.
    if (std::memcmp(&sa[i].second, &sb[i].second, sizeof(double)) == 0) continue;
    const std::string sep = mine.empty() ? "" : ", ";
    mine += sep + sa[i].first + " " + format_value(sa[i].second);
    theirs += sep + sb[i].first + " " + format_value(sb[i].second);
  }
  if (mine.empty()) return {};
  return detail::concat(who_a, " has ", mine, ", ", who_b, " ", theirs);
}

std::string first_non_finite(const float* values, int64_t n, int64_t first) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(values[i]))
      return detail::concat("element ", first + i, " is ", values[i]);
  return {};
}

}  // namespace hemiola::ps
