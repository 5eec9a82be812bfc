// What the block-scaled codings with error feedback (int8.cpp, int4.cpp)
// share: the residuals and the plain fallback (BlockCodedHost), adding and
// keeping the residuals (block_coding.h has the algorithm).
#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/codec/codings.h"

namespace hemiola {

BlockCodedHost::BlockCodedHost(Compression compression, const CodecSpec& spec)
    : Codec(compression), scale_(plain_scale(spec)) {
  residuals_.resize(spec.specs.size());
  for (size_t i = 0; i < spec.specs.size(); ++i) {
    // This rank's coding's residual, then the owner's (block_coding.h).
    if (spec.specs[i].dtype == DType::kFloat32) {
      residuals_[i].assign(2 * spec.specs[i].numel, 0.0f);
    }
  }
}

double BlockCodedHost::send(BucketStorage& storage, size_t b, uint64_t, Communicator& comm) {
  const PlannedBucket& plan = storage.layout().plan[b];
  if (!compressible(plan)) return send_plain_host(storage, b, comm, scale_);
  reduce(plan, reinterpret_cast<float*>(storage.buffer(b)), comm, storage.used());
  return 1.0;  // averaged on the wire
}

void add_residuals(const PlannedBucket& plan, float* data,
                   const std::vector<std::vector<float>>& residuals,
                   const std::vector<uint8_t>& used) {
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    if (!used[plan.tensors[k]]) continue;
    const float* residual = residuals[plan.tensors[k]].data() + plan.begins[k];
    float* v = data + plan.offsets[k];
    const size_t count = plan.counts[k];
    for (size_t j = 0; j < count; ++j) v[j] += residual[j];
  }
}

void keep_residuals(const PlannedBucket& plan, const float* data,
                    std::vector<std::vector<float>>& residuals,
                    const std::vector<uint8_t>& used) {
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    if (!used[plan.tensors[k]]) continue;
    float* residual = residuals[plan.tensors[k]].data() + plan.begins[k];
    const float* v = data + plan.offsets[k];
    std::copy(v, v + plan.counts[k], residual);
  }
}

}  // namespace hemiola
