#include "optim/cpu_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/dtype_dispatch.h"
#include "hemiola/status.h"

// The loops are inlined into functions compiled twice, for x86-64-v3 (AVX2 and
// FMA, where std::fma is one instruction and the loops vectorise, as torch's
// CPU kernels are) and for the baseline; the loader picks one at run time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HEMIOLA_OPTIM_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HEMIOLA_OPTIM_CLONES
#endif
#define HEMIOLA_INLINE __attribute__((always_inline)) inline
// Lambdas too: an out-of-line lambda would be compiled for the baseline only,
// not for the x86-64-v3 clone that calls it.
#define HEMIOLA_INLINE_LAMBDA __attribute__((always_inline))

namespace hemiola::optim {

namespace {

// The element types (core/dtype_dispatch.h) say how a storage dtype is read,
// computed in (float for float32 and the half types, double for float64) and
// written; C::round is what storing an intermediate tensor of torch's step
// does to a value. `alpha` is the scalar of a torch add(..., alpha=), which
// torch rounds to the tensor's dtype first (other ops take their scalar in
// the arithmetic type).
template <typename C>
typename C::Compute alpha(double a) {
  return C::round(static_cast<typename C::Compute>(a));
}

// torch's lerp, with the multiply-add fused as its CPU kernels fuse it (as they
// do for add with alpha and addcmul; addcdiv divides last and is not fused).
template <typename M>
HEMIOLA_INLINE M lerp(M self, M end, M weight) {
  return weight < M(0.5) ? std::fma(weight, end - self, self)
                         : std::fma(-(M(1) - weight), end - self, end);
}

// Calls f(std::integral_constant<int, value>{}) for value in [0, N): a
// run-time option becomes a compile-time one, so each combination of options
// gets a loop without branches in it (which is what lets it vectorise).
template <int N, int K = 0, typename F>
HEMIOLA_INLINE void with_choice(int value, F&& f) {
  if constexpr (K + 1 < N) {
    if (value != K) return with_choice<N, K + 1>(value, f);
  }
  f(std::integral_constant<int, K>{});
}

// What a step writes: the live parameters only (the approximate step), or
// committing, the live parameters and the shadow, or both once when they are
// the same memory. The two pointers of kBoth never overlap, so the compiler's
// run-time overlap check passes and the loop stays vectorised.
enum Write : int { kLive = 0, kBoth = 1, kInPlace = 2 };

int write_of(const void* param, const void* shadow, bool commit) {
  return !commit ? kLive : param == shadow ? kInPlace : kBoth;
}

template <int kWrite, typename S>
HEMIOLA_INLINE void write(S* param, S* shadow, std::int64_t i, S value) {
  if constexpr (kWrite == kInPlace) {
    shadow[i] = value;
  } else {
    param[i] = value;
    if constexpr (kWrite == kBoth) shadow[i] = value;
  }
}

// SGD's momentum: none, the first step (the buffer is created), or later
// steps; each plain or Nesterov.
enum Momentum : int { kNone = 0, kFirst = 1, kFirstNesterov = 2, kPlain = 3, kNesterov = 4 };

int momentum_of(const SgdHyper& h) {
  if (h.momentum == 0.0) return kNone;
  if (h.first_step) return h.nesterov ? kFirstNesterov : kFirst;
  return h.nesterov ? kNesterov : kPlain;
}

template <typename C, int kMomentum, bool kDecay, int kWrite>
HEMIOLA_INLINE void sgd_loop(const SgdTensors& t, std::int64_t n, const SgdHyper& h) {
  constexpr bool kCommit = kWrite != kLive;
  constexpr bool kIsFirst = kMomentum == kFirst || kMomentum == kFirstNesterov;
  constexpr bool kIsNesterov = kMomentum == kFirstNesterov || kMomentum == kNesterov;
  using S = typename C::Storage;
  using M = typename C::Compute;
  auto* param = static_cast<S*>(t.param);
  auto* shadow = static_cast<S*>(t.shadow);
  auto* buf = static_cast<S*>(t.momentum);
  const auto* grad = static_cast<const S*>(t.grad);
  // torch turns Python floats into the arithmetic type once, per op.
  const M wd = alpha<C>(h.weight_decay);
  const M mu = static_cast<M>(h.momentum);  // buf.mul_(momentum)
  const M mu_alpha = alpha<C>(h.momentum);  // grad.add(buf, alpha=momentum)
  const M keep = alpha<C>(1.0 - h.dampening);
  const M neg_lr = alpha<C>(-h.lr);
  // grad * coef (a float32 coefficient), negated under maximize: exact when
  // the coefficient is 1, and rounding is symmetric, so one multiply does both.
  const float coef = static_cast<float>(h.grad_scale);
  const M factor = static_cast<M>(h.maximize ? -coef : coef);
  for (std::int64_t i = 0; i < n; ++i) {
    const M w = C::load(shadow[i]);
    M g = C::round(C::load(grad[i]) * factor);
    if constexpr (kDecay) g = C::round(std::fma(wd, w, g));  // grad.add(param, alpha=wd)
    M d = g;
    if constexpr (kMomentum != kNone) {
      M b;
      if constexpr (kIsFirst) {
        b = g;                                                // buf = clone(grad)
      } else {
        b = C::round(std::fma(keep, g, C::round(C::load(buf[i]) * mu)));
      }
      if constexpr (kCommit) buf[i] = C::store(b);            // (buf.mul_(mu).add_(g, alpha=keep))
      if constexpr (kIsNesterov) {
        d = C::round(std::fma(mu_alpha, b, g));               // grad.add(buf, alpha=mu)
      } else {
        d = b;
      }
    }
    write<kWrite>(param, shadow, i, C::store(std::fma(neg_lr, d, w)));
  }
}

template <typename C>
HEMIOLA_INLINE void sgd(const SgdTensors& t, std::int64_t n, const SgdHyper& h, bool commit) {
  with_choice<5>(momentum_of(h), [&](auto kMomentum) HEMIOLA_INLINE_LAMBDA {
    with_choice<2>(h.weight_decay != 0.0, [&](auto kDecay) HEMIOLA_INLINE_LAMBDA {
      const int written = write_of(t.param, t.shadow, commit);
      with_choice<3>(written, [&](auto kWrite) HEMIOLA_INLINE_LAMBDA {
        sgd_loop<C, kMomentum, kDecay != 0, kWrite>(t, n, h);
      });
    });
  });
}

// Adam's weight decay: none, L2 (Adam's), or decoupled (AdamW's).
enum Decay : int { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

// The square root of `n` values into `out`: the step's injected one for
// float32 and float64 when there is one (VectorSqrt), else std::sqrt.
template <typename C, typename M = typename C::Compute>
HEMIOLA_INLINE void take_sqrt(const M* in, M* out, std::int64_t n, const VectorSqrt& vector_sqrt) {
  if constexpr (C::dtype == DType::kFloat32) {
    if (vector_sqrt.f32) return vector_sqrt.f32(&n, in, out);
  } else if constexpr (C::dtype == DType::kFloat64) {
    if (vector_sqrt.f64) return vector_sqrt.f64(&n, in, out);
  }
  for (std::int64_t i = 0; i < n; ++i) out[i] = C::round(std::sqrt(in[i]));
}

// In blocks of kAdamBlock elements, so that the square root between the
// moments and the update can be a vector call (torch's own: see VectorSqrt):
// pass 1 computes the moments (and commits them), the root is taken of the
// block, pass 2 the update. Each pass is a branch-free loop that vectorises.
constexpr std::int64_t kAdamBlock = 512;

template <typename C, int kDecay, bool kAmsgrad, int kWrite>
HEMIOLA_INLINE void adam_loop(const AdamTensors& t, std::int64_t n, const AdamHyper& h) {
  constexpr bool kCommit = kWrite != kLive;
  using S = typename C::Storage;
  using M = typename C::Compute;
  auto* param = static_cast<S*>(t.param);
  auto* shadow = static_cast<S*>(t.shadow);
  auto* exp_avg = static_cast<S*>(t.exp_avg);
  auto* exp_avg_sq = static_cast<S*>(t.exp_avg_sq);
  auto* vmax = static_cast<S*>(t.max_exp_avg_sq);
  const auto* grad = static_cast<const S*>(t.grad);
  const double step = static_cast<double>(h.step);
  // As torch computes them: in double on the host, then one conversion.
  const double bias1 = 1.0 - std::pow(h.beta1, step);
  const double bias2 = 1.0 - std::pow(h.beta2, step);
  const M neg_step_size = static_cast<M>(-(h.lr / bias1));
  const M bias2_sqrt = static_cast<M>(std::pow(bias2, 0.5));  // Python's ** 0.5
  const M decay = static_cast<M>(1.0 - h.lr * h.weight_decay);
  const M wd = alpha<C>(h.weight_decay);
  const M one_minus_beta1 = static_cast<M>(1.0 - h.beta1);
  const M beta2 = static_cast<M>(h.beta2);
  const M one_minus_beta2 = static_cast<M>(1.0 - h.beta2);
  const M eps = static_cast<M>(h.eps);
  const float coef = static_cast<float>(h.grad_scale);  // as in sgd_loop
  const M factor = static_cast<M>(h.maximize ? -coef : coef);
  M w_block[kAdamBlock];
  M m_block[kAdamBlock];
  M v_block[kAdamBlock];     // v^, the moment whose root is taken
  M root_block[kAdamBlock];  // sqrt(v^)
  for (std::int64_t begin = 0; begin < n; begin += kAdamBlock) {
    const std::int64_t len = std::min(kAdamBlock, n - begin);
    for (std::int64_t j = 0; j < len; ++j) {
      const std::int64_t i = begin + j;
      M w = C::load(shadow[i]);
      M g = C::round(C::load(grad[i]) * factor);
      if constexpr (kDecay == kDecoupled) {
        w = C::round(w * decay);                            // param.mul_(1 - lr * wd)
      } else if constexpr (kDecay == kL2) {
        g = C::round(std::fma(wd, w, g));                   // grad.add(param, alpha=wd)
      }
      const M m_old = C::load(exp_avg[i]);
      const M m = C::round(lerp(m_old, g, one_minus_beta1));  // exp_avg.lerp_(grad, 1 - beta1)
      const M v = C::round(std::fma(one_minus_beta2 * g, g,  // exp_avg_sq.mul_(beta2)
                                    C::round(C::load(exp_avg_sq[i]) * beta2)));  // .addcmul_
      M v_hat = v;
      if constexpr (kAmsgrad) {
        v_hat = std::max(C::load(vmax[i]), v);              // torch.maximum(vmax, v, out=vmax)
        if constexpr (kCommit) vmax[i] = C::store(v_hat);
      }
      if constexpr (kCommit) {
        exp_avg[i] = C::store(m);
        exp_avg_sq[i] = C::store(v);
      }
      w_block[j] = w;
      m_block[j] = m;
      v_block[j] = v_hat;
    }
    take_sqrt<C>(v_block, root_block, len, h.sqrt);         // exp_avg_sq.sqrt()
    for (std::int64_t j = 0; j < len; ++j) {
      const M denom = C::round(C::round(root_block[j] / bias2_sqrt) + eps);  // (/ bc2_sqrt).add_(eps)
      write<kWrite>(param, shadow, begin + j,
                    C::store(w_block[j] + (neg_step_size * m_block[j]) / denom));  // addcdiv_
    }
  }
}

template <typename C>
HEMIOLA_INLINE void adam(const AdamTensors& t, std::int64_t n, const AdamHyper& h, bool commit) {
  const int decay = h.weight_decay == 0.0 ? kNoDecay : h.decoupled_weight_decay ? kDecoupled : kL2;
  with_choice<3>(decay, [&](auto kDecay) HEMIOLA_INLINE_LAMBDA {
    with_choice<2>(h.amsgrad, [&](auto kAmsgrad) HEMIOLA_INLINE_LAMBDA {
      const int written = write_of(t.param, t.shadow, commit);
      with_choice<3>(written, [&](auto kWrite) HEMIOLA_INLINE_LAMBDA {
        adam_loop<C, kDecay, kAmsgrad != 0, kWrite>(t, n, h);
      });
    });
  });
}

}  // namespace

HEMIOLA_OPTIM_CLONES void cpu_sgd_step(const SgdTensors& t, std::int64_t numel, DType dtype,
                                       const SgdHyper& hyper, bool commit) {
  for_floating(
      dtype, [&](auto c) HEMIOLA_INLINE_LAMBDA { sgd<decltype(c)>(t, numel, hyper, commit); },
      "optimizer step: dtype ", dtype, " is not a floating dtype");
}

HEMIOLA_OPTIM_CLONES void cpu_adam_step(const AdamTensors& t, std::int64_t numel, DType dtype,
                   const AdamHyper& hyper, bool commit) {
  for_floating(
      dtype, [&](auto c) HEMIOLA_INLINE_LAMBDA { adam<decltype(c)>(t, numel, hyper, commit); },
      "optimizer step: dtype ", dtype, " is not a floating dtype");
}

}  // namespace hemiola::optim
