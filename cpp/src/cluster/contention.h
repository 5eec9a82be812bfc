// The communication contention model (Wang et al. 2020) and the set
// of transfers in flight on the cluster's network interfaces.
#pragma once

#include <utility>
#include <vector>

#include "model.h"

namespace hemiola::cluster {

// Per-transfer rate in MB/ms when k >= 1 transfers share a network interface:
// 1 / (k*beta + (k-1)*eta). k = 1 is the uncontended rate 1/beta.
double transfer_rate(int k, const ClusterSpec& cluster);

// AdaDUAL's threshold 2(beta+eta)/beta: a new transfer of size M may share a
// link with one running transfer of remaining size R only if R/M >= threshold,
// which is exactly when sharing lowers the summed completion time of the two.
double adadual_threshold(const ClusterSpec& cluster);
bool adadual_may_share(double running_remaining_mb, double new_size_mb, const ClusterSpec& cluster);

// Transfers in flight. Each transfer uses the network interface of every node
// it spans; its rate is transfer_rate(k) where k is the number of transfers on
// the busiest of those interfaces. Rates are recomputed whenever a transfer
// starts or ends, i.e. whenever some k changes.
//
// Invariant: progress happens only in advance_to(); reading a remaining size
// never moves a transfer (the published simulator did, adding phantom
// progress whenever a waiting job looked at a running transfer).
class Network {
 public:
  struct Completed {
    int id;
    double moved_mb;  // total volume this transfer moved (== its size up to rounding)
  };

  explicit Network(const ClusterSpec& cluster);

  // Starts transfer `id` (unique among active ones) of `size_mb` over `nodes`
  // at the current clock.
  void start(int id, const std::vector<int>& nodes, double size_mb);
  // Moves the clock to `t_ms` (>= now): every transfer progresses at its
  // current rate; those whose finish time is <= t_ms complete and are returned
  // (ascending id), and the rates of the rest are recomputed.
  std::vector<Completed> advance_to(double t_ms);

  double now_ms() const { return now_; }
  // Earliest finish time of an active transfer; +inf when none is active.
  double next_finish_ms() const;
  // Ids of the transfers currently using `node`'s interface.
  const std::vector<int>& on_node(int node) const { return on_node_[node]; }
  bool is_active(int id) const;
  double remaining_mb(int id) const;  // 0 if not active
  double rate(int id) const;          // MB/ms; 0 if not active
  size_t size() const { return active_.size(); }

 private:
  struct Transfer {
    int id;
    std::vector<int> nodes;
    double remaining_mb;
    double moved_mb;
    double rate;       // MB/ms at the current contention
    double finish_ms;  // now_ + remaining_mb / rate
  };
  const Transfer* find(int id) const;
  void recompute_rates();

  ClusterSpec cluster_;
  double now_ = 0.0;
  std::vector<Transfer> active_;
  std::vector<std::vector<int>> on_node_;
};

}  // namespace hemiola::cluster
