// optim/global_scale.h. The clipping coefficient follows torch's
// clip_grad_norm_ rounding by rounding: per-tensor norms and the total norm
// are tensors of the gradients' dtype, and so is the coefficient
// clamp(max_norm / (total + 1e-6), max=1) (in bfloat16 that rounding is 0.4%,
// far above the tolerance a run is compared with DDP's at).
#include "optim/global_scale.h"

#include <algorithm>
#include <cmath>

#include "optim/grad_norm.h"

namespace hemiola::optim {

namespace {

// The dtype torch.stack gives norms of dtypes a and b.
DType promote(DType a, DType b) {
  if (a == b) return a;
  if (a == DType::kFloat64 || b == DType::kFloat64) return DType::kFloat64;
  return DType::kFloat32;  // float32 with a half type, or bfloat16 with float16
}

}  // namespace

GlobalScale global_scale(const std::vector<HostGrad>& grads, double clip_max_norm,
                         double clip_norm_type, bool skip_if_not_finite,
                         const double* total_norm) {
  const double p = clip_max_norm >= 0.0 ? clip_norm_type : 2.0;
  const bool inf_norm = std::isinf(p);
  // With the caller's total, the elements are read only for the skip.
  const bool count = total_norm == nullptr || skip_if_not_finite;
  double exact = 0.0;    // all elements, unrounded
  double rounded = 0.0;  // over the per-tensor norms rounded to their dtype
  DType total_dtype = DType::kBFloat16;
  bool first = true;
  for (const HostGrad& t : grads) {
    total_dtype = first ? t.dtype : promote(total_dtype, t.dtype);
    first = false;
    if (!count) continue;
    double acc = 0.0;
    accumulate_norm(t.data, t.numel, t.dtype, p, acc);
    const double norm = round_to(t.dtype, finish_norm(acc, p));
    if (inf_norm) {
      if (std::isnan(acc) || acc > exact) exact = acc;
      if (std::isnan(norm) || norm > rounded) rounded = norm;
    } else {
      exact += acc;
      rounded += std::pow(norm, p);
    }
  }
  GlobalScale scale;
  scale.skip = skip_if_not_finite && !std::isfinite(finish_norm(exact, p));
  if (clip_max_norm >= 0.0) {
    const DType d = total_dtype;
    const double total = round_to(
        d, total_norm ? *total_norm : inf_norm ? rounded : std::pow(rounded, 1.0 / p));
    // max_norm / x is reciprocal(x) * max_norm for a tensor x.
    const double inverse = round_to(d, 1.0 / round_to(d, total + 1e-6));
    const float product = static_cast<float>(inverse) * static_cast<float>(clip_max_norm);
    const double coef = round_to(d, static_cast<double>(product));
    scale.coef = std::min(1.0, d == DType::kFloat64 ? inverse * clip_max_norm : coef);
    scale.total_norm = total;
  }
  return scale;
}

}  // namespace hemiola::optim
