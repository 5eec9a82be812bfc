#include "engine/codec/powersgd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "engine/codec/codings.h"
#include "hemiola/status.h"
#include "optim/grad_norm.h"

namespace hemiola {

namespace {

// Orthonormalises the `rank` columns (each `n` long, stored one after the
// other) in place: modified Gram-Schmidt as torch's _orthogonalize_gram_schmidt
// with a small epsilon (an all-zero column stays zero instead of NaN).
void orthogonalise(float* columns, size_t n, size_t rank) {
  constexpr double kEpsilon = 1e-8;
  for (size_t i = 0; i < rank; ++i) {
    float* col = columns + i * n;
    double norm = 0.0;
    for (size_t r = 0; r < n; ++r) norm += static_cast<double>(col[r]) * col[r];
    const float inverse = static_cast<float>(1.0 / (std::sqrt(norm) + kEpsilon));
    for (size_t r = 0; r < n; ++r) col[r] *= inverse;
    for (size_t j = i + 1; j < rank; ++j) {
      float* other = columns + j * n;
      double dot = 0.0;
      for (size_t r = 0; r < n; ++r) dot += static_cast<double>(col[r]) * other[r];
      const float d = static_cast<float>(dot);
      for (size_t r = 0; r < n; ++r) other[r] -= d * col[r];
    }
  }
}

// p[:, k] = M q[:, k] for an n x m row-major M and column-major p, q.
void multiply(const float* m, size_t n, size_t cols, const float* q, size_t rank, float* p) {
  for (size_t i = 0; i < n; ++i) {
    const float* row = m + i * cols;
    for (size_t k = 0; k < rank; ++k) {
      const float* qk = q + k * cols;
      // Eight partial sums: independent chains the compiler can pipeline.
      float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      size_t j = 0;
      for (; j + 8 <= cols; j += 8) {
        for (size_t u = 0; u < 8; ++u) s[u] += row[j + u] * qk[j + u];
      }
      float tail = 0.0f;
      for (; j < cols; ++j) tail += row[j] * qk[j];
      p[k * n + i] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail;
    }
  }
}

// q[:, k] = M^T p[:, k].
void multiply_transposed(const float* m, size_t n, size_t cols, const float* p, size_t rank,
                         float* q) {
  std::fill(q, q + cols * rank, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    const float* row = m + i * cols;
    for (size_t k = 0; k < rank; ++k) {
      const float pik = p[k * n + i];
      float* qk = q + k * cols;
      for (size_t j = 0; j < cols; ++j) qk[j] += row[j] * pik;
    }
  }
}

}  // namespace

PowerSgd::PowerSgd(const std::vector<GradSpec>& specs, size_t rank, int world)
    : specs_(specs), rank_(rank), world_(world) {
  HEMIOLA_CHECK(rank >= 1, "powersgd_rank must be at least 1, got ", rank);
  residuals_.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const GradSpec& spec = specs[i];
    if (spec.dtype != DType::kFloat32 || spec.rows <= 1 || spec.numel % spec.rows != 0) continue;
    const size_t cols = spec.numel / spec.rows;
    const size_t r = std::min({rank, spec.rows, cols});
    // Only a tensor worth compressing whole keeps a residual (a piece of it
    // that holds no whole rows leaves its part of the residual at zero).
    if (cols > 1 && (spec.rows + cols) * r * 2 < spec.numel) residuals_[i].assign(spec.numel, 0.0f);
  }
}

size_t PowerSgd::compressible_rows(const PlannedBucket& plan, size_t k) const {
  const GradSpec& spec = specs_[plan.tensors[k]];
  if (spec.rows <= 1 || spec.numel % spec.rows != 0) return 0;
  const size_t cols = spec.numel / spec.rows;
  // A piece of a partitioned tensor qualifies when it holds whole rows.
  if (residuals_[plan.tensors[k]].empty()) return 0;
  if (cols <= 1 || plan.begins[k] % cols != 0 || plan.counts[k] % cols != 0) return 0;
  const size_t rows = plan.counts[k] / cols;
  const size_t rank = std::min({rank_, rows, cols});
  return (rows + cols) * rank * 2 < rows * cols ? rows : 0;
}

std::vector<float>& PowerSgd::warm_q(size_t tensor, size_t begin, size_t cols, size_t rank) {
  std::vector<float>& q = qs_[{tensor, begin}];
  // A warm Q with a (near) zero column, left by a zero gradient, would stay
  // zero for ever: P = M Q = 0, and Q = M^T P = 0 again. Start such a Q
  // afresh. Q comes from sums every rank shares, so every rank decides alike.
  bool fresh = q.size() != cols * rank;
  for (size_t k = 0; k < rank && !fresh; ++k) {
    double norm = 0.0;
    for (size_t j = 0; j < cols; ++j) norm += static_cast<double>(q[k * cols + j]) * q[k * cols + j];
    fresh = !(norm > 1e-30);  // also NaN
  }
  if (fresh) {
    // The same seeded start on every rank.
    std::mt19937 rng(static_cast<unsigned>(1000003u * tensor + begin + 17u));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    q.resize(cols * rank);
    for (float& x : q) x = normal(rng);
  }
  orthogonalise(q.data(), cols, rank);  // torch orthogonalises a warm Q again
  return q;
}

void PowerSgd::reduce_average(const PlannedBucket& plan, float* data, Communicator& comm,
                              const std::vector<uint8_t>& used) {
  const float world = static_cast<float>(world_);
  std::vector<Matrix> matrices;
  uncompressed_.clear();
  size_t p_size = 0;
  size_t q_size = 0;
  for (size_t k = 0; k < plan.tensors.size(); ++k) {
    float* piece = data + plan.offsets[k];
    const size_t rows = compressible_rows(plan, k);
    if (rows == 0) {
      uncompressed_.insert(uncompressed_.end(), piece, piece + plan.counts[k]);
      continue;
    }
    const size_t t = plan.tensors[k];
    const size_t cols = plan.counts[k] / rows;
    const size_t rank = std::min({rank_, rows, cols});
    // A tensor this rank did not use contributes zeros and keeps its residual.
    if (used[t]) {
      const float* residual = residuals_[t].data() + plan.begins[k];
      for (size_t j = 0; j < plan.counts[k]; ++j) piece[j] += residual[j];
    }
    matrices.push_back({k, rows, cols, rank, warm_q(t, plan.begins[k], cols, rank).data()});
    p_size += rows * rank;
    q_size += cols * rank;
  }
  // The uncompressed tensors, averaged as they are.
  if (!uncompressed_.empty()) {
    comm.all_reduce_sum(TensorRef{uncompressed_.data(), DType::kFloat32, uncompressed_.size(), {}});
    size_t at = 0;
    for (size_t k = 0; k < plan.tensors.size(); ++k) {
      if (compressible_rows(plan, k) != 0) continue;
      float* piece = data + plan.offsets[k];
      for (size_t j = 0; j < plan.counts[k]; ++j) piece[j] = uncompressed_[at + j] / world;
      at += plan.counts[k];
    }
  }
  if (matrices.empty()) return;
  // P = M Q, summed over the ranks, orthogonalised.
  ps_.resize(p_size);
  size_t at = 0;
  for (const Matrix& mx : matrices) {
    multiply(data + plan.offsets[mx.piece], mx.rows, mx.cols, mx.q, mx.rank, ps_.data() + at);
    at += mx.rows * mx.rank;
  }
  comm.all_reduce_sum(TensorRef{ps_.data(), DType::kFloat32, ps_.size(), {}});
  // A non-finite value in any rank's M makes its summed P non-finite on every
  // rank alike: that matrix's average is delivered as NaN (as an
  // uncompressed all-reduce would carry it, so check_finite and a GradScaler
  // see it), and its residual and warm start are dropped, so the next
  // iterations are clean.
  std::vector<bool> finite(matrices.size(), true);
  at = 0;
  for (size_t x = 0; x < matrices.size(); ++x) {
    const Matrix& mx = matrices[x];
    finite[x] = optim::all_finite(ps_.data() + at,
                                  static_cast<std::int64_t>(mx.rows * mx.rank), DType::kFloat32);
    if (finite[x]) orthogonalise(ps_.data() + at, mx.rows, mx.rank);
    at += mx.rows * mx.rank;
  }
  // Q = M^T P, summed over the ranks and averaged.
  qsum_.resize(q_size);
  at = 0;
  size_t qat = 0;
  for (size_t x = 0; x < matrices.size(); ++x) {
    const Matrix& mx = matrices[x];
    multiply_transposed(data + plan.offsets[mx.piece], mx.rows, mx.cols, ps_.data() + at,
                        mx.rank, qsum_.data() + qat);
    at += mx.rows * mx.rank;
    qat += mx.cols * mx.rank;
  }
  comm.all_reduce_sum(TensorRef{qsum_.data(), DType::kFloat32, qsum_.size(), {}});
  for (float& x : qsum_) x /= world;
  // The average is P Q^T; the residual keeps what it missed of this rank's M.
  at = 0;
  qat = 0;
  for (size_t x = 0; x < matrices.size(); ++x) {
    const Matrix& mx = matrices[x];
    float* m = data + plan.offsets[mx.piece];
    const size_t t = plan.tensors[mx.piece];
    float* residual = residuals_[t].data() + plan.begins[mx.piece];
    const float* p = ps_.data() + at;
    const float* q = qsum_.data() + qat;
    if (!finite[x] ||
        !optim::all_finite(q, static_cast<std::int64_t>(mx.cols * mx.rank), DType::kFloat32)) {
      const size_t n = mx.rows * mx.cols;
      std::fill(m, m + n, std::numeric_limits<float>::quiet_NaN());
      std::fill(residual, residual + n, 0.0f);
      std::fill(mx.q, mx.q + mx.cols * mx.rank, 0.0f);  // warm_q starts it afresh
      at += mx.rows * mx.rank;
      qat += mx.cols * mx.rank;
      continue;
    }
    approx_.resize(mx.cols);
    for (size_t i = 0; i < mx.rows; ++i) {
      std::fill(approx_.begin(), approx_.end(), 0.0f);
      for (size_t k = 0; k < mx.rank; ++k) {
        const float pik = p[k * mx.rows + i];
        const float* qk = q + k * mx.cols;
        for (size_t j = 0; j < mx.cols; ++j) approx_[j] += pik * qk[j];
      }
      float* row = m + i * mx.cols;
      float* res = residual + i * mx.cols;
      for (size_t j = 0; j < mx.cols; ++j) {
        if (used[t]) res[j] = row[j] - approx_[j];
        row[j] = approx_[j];
      }
    }
    std::copy(q, q + mx.cols * mx.rank, mx.q);  // the warm start of the next iteration
    at += mx.rows * mx.rank;
    qat += mx.cols * mx.rank;
  }
}

namespace {

// kPowerSgd as a coding: from iteration `powersgd_start_iteration` on; before
// that (the warm-up), a bucket travels uncompressed, as none sends it.
class PowerSgdHost final : public Codec {
 public:
  explicit PowerSgdHost(const CodecSpec& spec)
      : Codec(Compression::kPowerSgd), start_(spec.powersgd_start_iteration),
        scale_(plain_scale(spec)), powersgd_(spec.specs, spec.powersgd_rank, spec.world_size) {}

  std::vector<float>* residual(size_t index) override { return &powersgd_.residual(index); }

 protected:
  double send(BucketStorage& storage, size_t b, uint64_t iteration, Communicator& comm) override {
    const PlannedBucket& plan = storage.layout().plan[b];
    if (iteration < start_ || !compressible(plan)) {
      return send_plain_host(storage, b, comm, scale_);
    }
    powersgd_.reduce_average(plan, reinterpret_cast<float*>(storage.buffer(b)), comm,
                             storage.used());
    return 1.0;  // averaged on the wire
  }

 private:
  const uint64_t start_;
  const double scale_;  // an uncompressed bucket's: 1/world when averaging
  PowerSgd powersgd_;
};

}  // namespace

std::unique_ptr<Codec> make_powersgd_codec(const CodecSpec& spec) {
  return std::make_unique<PowerSgdHost>(spec);
}

}  // namespace hemiola
