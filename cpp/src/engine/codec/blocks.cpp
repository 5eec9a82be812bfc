// What the block-scaled codings with error feedback (int8.cpp, int4.cpp)
// share: the residuals and the plain fallback (BlockCodedHost), adding and
// keeping the residuals, and agreeing on one maximum per block across ranks.
#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/codec/codings.h"

namespace hemiola {

BlockCodedHost::BlockCodedHost(Compression compression, const CodecSpec& spec)
    : Codec(compression), world_(spec.world_size), scale_(plain_scale(spec)) {
  residuals_.resize(spec.specs.size());
  for (size_t i = 0; i < spec.specs.size(); ++i) {
    if (spec.specs[i].dtype == DType::kFloat32) residuals_[i].assign(spec.specs[i].numel, 0.0f);
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

void agree_block_maxima(const float* data, size_t n, Communicator& comm, int world,
                        std::vector<float>& maxima, std::vector<float>& gathered) {
  const size_t blocks = (n + kInt8Block - 1) / kInt8Block;
  // This rank's max |v| per block (NaN when the block holds a non-finite
  // value: max() drops NaN, so a separate finiteness test).
  maxima.resize(blocks);
  for (size_t blk = 0; blk < blocks; ++blk) {
    const size_t first = blk * kInt8Block;
    const size_t end = std::min(n, first + kInt8Block);
    float m = 0.0f;
    float bad = 0.0f;  // stays 0 while every value is finite
    for (size_t i = first; i < end; ++i) {
      const float a = std::fabs(data[i]);
      m = std::max(m, a);
      bad += a - a;  // NaN for an infinite or NaN value
    }
    maxima[blk] = bad == 0.0f ? m : std::numeric_limits<float>::quiet_NaN();
  }
  gathered.resize(blocks * static_cast<size_t>(world));
  comm.all_gather(TensorRef{maxima.data(), DType::kFloat32, blocks, Device{}},
                  TensorRef{gathered.data(), DType::kFloat32, gathered.size(), Device{}});
  // The max over the ranks, NaN if any rank's is: the same everywhere.
  for (size_t blk = 0; blk < blocks; ++blk) {
    float m = 0.0f;
    for (int r = 0; r < world; ++r) {
      const float x = gathered[static_cast<size_t>(r) * blocks + blk];
      m = std::isnan(x) || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN()
                                         : std::max(m, x);
    }
    maxima[blk] = m;
  }
}

}  // namespace hemiola
