#include "contention.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace hemiola::cluster {

double transfer_rate(int k, const ClusterSpec& c) {
  if (k < 1) throw std::invalid_argument("transfer_rate: k must be >= 1");
  return 1.0 / (k * c.beta_ms_per_mb + (k - 1) * c.eta_ms_per_mb);
}

double adadual_threshold(const ClusterSpec& c) {
  return 2.0 * (c.beta_ms_per_mb + c.eta_ms_per_mb) / c.beta_ms_per_mb;
}

bool adadual_may_share(double running_remaining_mb, double new_size_mb, const ClusterSpec& c) {
  // Written as a product so that a zero-size new transfer is always allowed.
  return running_remaining_mb >= adadual_threshold(c) * new_size_mb;
}

Network::Network(const ClusterSpec& cluster) : cluster_(cluster), on_node_(cluster.nodes) {}

const Network::Transfer* Network::find(int id) const {
  for (const auto& t : active_) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

bool Network::is_active(int id) const { return find(id) != nullptr; }
double Network::remaining_mb(int id) const {
  const Transfer* t = find(id);
  return t ? t->remaining_mb : 0.0;
}
double Network::rate(int id) const {
  const Transfer* t = find(id);
  return t ? t->rate : 0.0;
}

void Network::start(int id, const std::vector<int>& nodes, double size_mb) {
  if (is_active(id)) {
    throw std::logic_error("Network::start: transfer " + std::to_string(id) +
                           " is already active");
  }
  if (nodes.empty()) throw std::logic_error("Network::start: a transfer needs at least one node");
  if (!(size_mb >= 0.0)) throw std::invalid_argument("Network::start: size must be >= 0");
  active_.push_back({id, nodes, size_mb, 0.0, 0.0, now_});
  for (int n : nodes) on_node_.at(n).push_back(id);
  recompute_rates();
}

void Network::recompute_rates() {
  for (auto& t : active_) {
    size_t k = 1;
    for (int n : t.nodes) k = std::max(k, on_node_[n].size());
    t.rate = transfer_rate(static_cast<int>(k), cluster_);
    t.finish_ms = now_ + t.remaining_mb / t.rate;
  }
}

double Network::next_finish_ms() const {
  double next = std::numeric_limits<double>::infinity();
  for (const auto& t : active_) next = std::min(next, t.finish_ms);
  return next;
}

std::vector<Network::Completed> Network::advance_to(double t_ms) {
  if (t_ms < now_) throw std::logic_error("Network::advance_to: time cannot go backwards");
  const double dt = t_ms - now_;
  std::vector<Completed> done;
  for (auto& t : active_) {
    if (t.finish_ms <= t_ms) {
      t.moved_mb += t.remaining_mb;
      t.remaining_mb = 0.0;
      done.push_back({t.id, t.moved_mb});
    } else {
      const double moved = std::min(t.remaining_mb, t.rate * dt);
      t.moved_mb += moved;
      t.remaining_mb -= moved;
    }
  }
  now_ = t_ms;
  if (done.empty()) return done;
  for (const auto& c : done) {
    const Transfer* t = find(c.id);
    for (int n : t->nodes) {
      auto& v = on_node_[n];
      v.erase(std::find(v.begin(), v.end(), c.id));
    }
  }
  active_.erase(std::remove_if(active_.begin(), active_.end(),
                               [t_ms](const Transfer& t) { return t.finish_ms <= t_ms; }),
                active_.end());
  recompute_rates();
  std::sort(done.begin(), done.end(),
            [](const Completed& a, const Completed& b) { return a.id < b.id; });
  return done;
}

}  // namespace hemiola::cluster
