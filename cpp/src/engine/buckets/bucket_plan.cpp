#include "engine/buckets/bucket_plan.h"

#include <algorithm>
#include <map>

#include "hemiola/status.h"

namespace hemiola {

std::vector<std::vector<Placement>> place_pieces(const std::vector<PlannedBucket>& plan,
                                                 size_t tensors) {
  std::vector<std::vector<Placement>> placement(tensors);
  for (size_t b = 0; b < plan.size(); ++b) {
    const PlannedBucket& bucket = plan[b];
    for (size_t k = 0; k < bucket.tensors.size(); ++k) {
      placement[bucket.tensors[k]].push_back(
          {b, bucket.offsets[k], bucket.begins[k], bucket.counts[k]});
    }
  }
  return placement;
}

std::vector<size_t> reverse_order(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

void check_permutation(const std::vector<size_t>& order, size_t n) {
  HEMIOLA_CHECK(order.size() == n, "bucket order has ", order.size(), " entries, expected ", n);
  std::vector<bool> seen(n, false);
  for (size_t index : order) {
    HEMIOLA_CHECK(index < n, "bucket order names tensor ", index, " but there are only ", n);
    HEMIOLA_CHECK(!seen[index], "bucket order names tensor ", index, " twice");
    seen[index] = true;
  }
}

std::vector<PlannedBucket> plan_buckets(const std::vector<GradSpec>& specs,
                                        const std::vector<size_t>& order, size_t first_cap_bytes,
                                        size_t cap_bytes, size_t partition_bytes) {
  check_permutation(order, specs.size());
  struct Open {
    PlannedBucket bucket;
    size_t first_position = 0;
  };
  std::map<DType, Open> open;  // one open bucket per dtype
  std::vector<std::pair<size_t, PlannedBucket>> closed;  // (first position, bucket)

  auto close = [&](Open& o) {
    closed.emplace_back(o.first_position, std::move(o.bucket));
    o.bucket = PlannedBucket{};
  };
  for (size_t position = 0; position < order.size(); ++position) {
    const size_t index = order[position];
    const GradSpec& spec = specs[index];
    HEMIOLA_CHECK(is_floating(spec.dtype), "tensor ", index, " ('", spec.name, "') has dtype ",
                  dtype_name(spec.dtype), "; gradients must be float32, float64, float16 or bfloat16");
    Open& o = open[spec.dtype];
    const size_t elem = dtype_size(spec.dtype);
    const size_t piece = partition_bytes > 0 && spec.numel * elem > partition_bytes
                             ? std::max<size_t>(1, partition_bytes / elem)
                             : std::max<size_t>(1, spec.numel);
    size_t begin = 0;
    do {  // at least one piece, also for a zero-element tensor
      const size_t count = std::min(piece, spec.numel - begin);
      if (o.bucket.tensors.empty()) {
        o.bucket.dtype = spec.dtype;
        o.first_position = position;
      }
      o.bucket.tensors.push_back(index);
      o.bucket.begins.push_back(begin);
      o.bucket.counts.push_back(count);
      o.bucket.offsets.push_back(o.bucket.numel);
      o.bucket.numel += count;
      begin += count;
      const size_t cap = closed.empty() ? first_cap_bytes : cap_bytes;
      if (o.bucket.numel * elem >= cap) close(o);
    } while (begin < spec.numel);
  }
  for (auto& [dtype, o] : open) {
    if (!o.bucket.tensors.empty()) close(o);
  }
  std::stable_sort(closed.begin(), closed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<PlannedBucket> buckets;
  buckets.reserve(closed.size());
  for (auto& entry : closed) buckets.push_back(std::move(entry.second));
  return buckets;
}

}  // namespace hemiola
