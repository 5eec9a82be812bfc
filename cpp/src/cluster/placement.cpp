#include "placement.h"

#include <algorithm>
#include <numeric>

namespace hemiola::cluster {

namespace {
// Memory is compared with a small slack so that sums of model sizes that
// exactly fill a GPU are not rejected by rounding.
constexpr double kMemorySlackMb = 1e-6;

bool fits(double free_mb, double need_mb) { return free_mb + kMemorySlackMb >= need_mb; }
}  // namespace

std::vector<int> place_job(const PolicyConfig& policy, const ClusterSpec& cluster,
                           const std::vector<double>& free_memory_mb,
                           const std::vector<double>& load_ms, const PlacementRequest& req,
                           Rng& rng) {
  const int n = cluster.total_gpus();
  std::vector<int> eligible;
  eligible.reserve(n);
  for (int g = 0; g < n; ++g) {
    if (fits(free_memory_mb[g], req.memory_mb)) eligible.push_back(g);
  }
  if (static_cast<int>(eligible.size()) < req.num_gpus) return {};

  std::vector<int> chosen;
  switch (policy.placement) {
    case PlacementKind::kFirstFit:
      chosen.assign(eligible.begin(), eligible.begin() + req.num_gpus);
      break;
    case PlacementKind::kRandom:
      // Partial Fisher-Yates over the eligible GPUs.
      for (int i = 0; i < req.num_gpus; ++i) {
        const auto last = static_cast<long long>(eligible.size()) - 1;
        const auto j = static_cast<size_t>(rng.uniform_int(i, last));
        std::swap(eligible[i], eligible[j]);
      }
      chosen.assign(eligible.begin(), eligible.begin() + req.num_gpus);
      break;
    case PlacementKind::kLeastWorkloadFirst: {
      auto by_load = [&](int a, int b) {
        return load_ms[a] != load_ms[b] ? load_ms[a] < load_ms[b] : a < b;
      };
      if (req.num_gpus <= policy.kappa) {
        std::partial_sort(eligible.begin(), eligible.begin() + req.num_gpus, eligible.end(),
                          by_load);
        chosen.assign(eligible.begin(), eligible.begin() + req.num_gpus);
      } else {
        std::vector<double> node_load(cluster.nodes, 0.0);
        for (int g = 0; g < n; ++g) node_load[cluster.node_of(g)] += load_ms[g];
        std::vector<int> nodes(cluster.nodes);
        std::iota(nodes.begin(), nodes.end(), 0);
        std::stable_sort(nodes.begin(), nodes.end(),
                         [&](int a, int b) { return node_load[a] < node_load[b]; });
        std::vector<std::vector<int>> per_node(cluster.nodes);
        for (int g : eligible) per_node[cluster.node_of(g)].push_back(g);
        for (int node : nodes) {
          auto& gs = per_node[node];
          std::sort(gs.begin(), gs.end(), by_load);
          for (int g : gs) {
            if (static_cast<int>(chosen.size()) == req.num_gpus) break;
            chosen.push_back(g);
          }
          if (static_cast<int>(chosen.size()) == req.num_gpus) break;
        }
      }
      break;
    }
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

}  // namespace hemiola::cluster
