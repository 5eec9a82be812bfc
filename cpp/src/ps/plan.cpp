// Shard planning and the small enum helpers of the public ps.h.
#include <algorithm>
#include <numeric>

#include "hemiola/ps.h"
#include "hemiola/status.h"

namespace hemiola::ps {

const char* consistency_name(Consistency c) {
  switch (c) {
    case Consistency::kBsp: return "bsp";
    case Consistency::kAsp: return "asp";
    case Consistency::kSsp: return "ssp";
    case Consistency::kEager: return "eager";
  }
  return "unknown";
}

Consistency consistency_from_name(const std::string& name) {
  for (auto c : {Consistency::kBsp, Consistency::kAsp, Consistency::kSsp, Consistency::kEager})
    if (name == consistency_name(c)) return c;
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown consistency '", name,
                "'; choose one of bsp, asp, ssp, eager");
}

StalenessRule staleness_rule_from_name(const std::string& name) {
  if (name == "none") return StalenessRule::kNone;
  if (name == "inverse") return StalenessRule::kInverse;
  if (name == "zhang") return StalenessRule::kZhang;
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown staleness rule '", name,
                "'; choose one of none, inverse (lr/(1+tau)), zhang (lr/max(1,tau))");
}

MomentumRule momentum_rule_from_name(const std::string& name) {
  if (name == "none") return MomentumRule::kNone;
  if (name == "compensated") return MomentumRule::kCompensated;
  if (name == "rescaled") return MomentumRule::kRescaled;
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown momentum rule '", name,
                "'; choose one of rescaled (bsp's momentum spread over a round's pushes), "
                "compensated (momentum/(1+tau)), none (torch's momentum on every push)");
}

double staleness_factor(StalenessRule rule, int64_t tau) {
  switch (rule) {
    case StalenessRule::kNone: return 1.0;
    case StalenessRule::kInverse: return 1.0 / (1.0 + static_cast<double>(tau));
    case StalenessRule::kZhang: return 1.0 / static_cast<double>(std::max<int64_t>(1, tau));
  }
  return 1.0;
}

std::vector<Shard> plan_shards(const std::vector<int64_t>& numels, int num_servers,
                               int64_t partition_elems) {
  HEMIOLA_CHECK(num_servers >= 1, "need at least one server, got ", num_servers);
  HEMIOLA_CHECK(partition_elems >= 1, "partition size must be positive, got ", partition_elems);
  std::vector<Shard> shards;
  for (size_t t = 0; t < numels.size(); ++t) {
    HEMIOLA_CHECK(numels[t] >= 0, "tensor ", t, " has a negative size");
    const int64_t n = numels[t];
    const int64_t parts = std::max<int64_t>(1, (n + partition_elems - 1) / partition_elems);
    for (int64_t p = 0; p < parts; ++p) {
      Shard s;
      s.key = static_cast<int32_t>(shards.size());
      s.tensor = static_cast<int32_t>(t);
      s.begin = n * p / parts;
      s.count = n * (p + 1) / parts - s.begin;
      shards.push_back(s);
    }
  }
  // Largest first to the least-loaded server: within 4/3 of the best balance.
  std::vector<size_t> order(shards.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return shards[a].count > shards[b].count; });
  std::vector<int64_t> load(static_cast<size_t>(num_servers), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    shards[i].server = static_cast<int32_t>(least);
    load[static_cast<size_t>(least)] += std::max<int64_t>(1, shards[i].count);
  }
  return shards;
}

}  // namespace hemiola::ps
