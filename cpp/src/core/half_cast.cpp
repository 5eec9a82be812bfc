#include "core/half_cast.h"

#include "core/half.h"
#include "hemiola/status.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HEMIOLA_HAVE_F16C_PATH 1
#endif

namespace hemiola {

namespace {

// bfloat16 without branches, so the loops vectorise: NaN keeps its sign and
// becomes quiet; everything else rounds to nearest, ties to even (as
// float_to_bf16).
inline uint16_t bf16_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? ((bits >> 16) | 0x40u) : rounded);
}

#ifdef HEMIOLA_HAVE_F16C_PATH
bool have_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}

__attribute__((target("avx,f16c"))) void to_fp16_f16c(const float* in, uint16_t* out, size_t n,
                                                      float divisor) {
  const __m256 d = _mm256_set1_ps(divisor);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(in + i);
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    if (divisor != 1.0f) {
      x = _mm256_div_ps(_mm256_cvtph_ps(h), d);
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) {
    const uint16_t h = float_to_fp16(in[i]);
    out[i] = divisor != 1.0f ? float_to_fp16(fp16_to_float(h) / divisor) : h;
  }
}

__attribute__((target("avx,f16c"))) void from_fp16_f16c(const uint16_t* in, float* out,
                                                        size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = fp16_to_float(in[i]);
}

__attribute__((target("avx,f16c"))) void sum_fp16_f16c(uint16_t* out, const uint16_t* a,
                                                       const uint16_t* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = float_to_fp16(fp16_to_float(a[i]) + fp16_to_float(b[i]));
}
#endif

void check_half(DType half) {
  HEMIOLA_CHECK(half == DType::kFloat16 || half == DType::kBFloat16,
                "expected float16 or bfloat16, got ", dtype_name(half));
}

}  // namespace

void floats_to_halves(DType half, const float* in, uint16_t* out, size_t n, float divisor) {
  check_half(half);
  if (half == DType::kFloat16) {
#ifdef HEMIOLA_HAVE_F16C_PATH
    if (have_f16c()) return to_fp16_f16c(in, out, n, divisor);
#endif
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = float_to_fp16(in[i]);
      out[i] = divisor != 1.0f ? float_to_fp16(fp16_to_float(h) / divisor) : h;
    }
    return;
  }
  if (divisor == 1.0f) {
    for (size_t i = 0; i < n; ++i) out[i] = bf16_of(in[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = bf16_of(bf16_to_float(bf16_of(in[i])) / divisor);
  }
}

void halves_to_floats(DType half, const uint16_t* in, float* out, size_t n) {
  check_half(half);
  if (half == DType::kFloat16) {
#ifdef HEMIOLA_HAVE_F16C_PATH
    if (have_f16c()) return from_fp16_f16c(in, out, n);
#endif
    for (size_t i = 0; i < n; ++i) out[i] = fp16_to_float(in[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void sum_halves(DType half, uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n) {
  check_half(half);
  if (half == DType::kFloat16) {
#ifdef HEMIOLA_HAVE_F16C_PATH
    if (have_f16c()) return sum_fp16_f16c(out, a, b, n);
#endif
    for (size_t i = 0; i < n; ++i) out[i] = float_to_fp16(fp16_to_float(a[i]) + fp16_to_float(b[i]));
    return;
  }
  for (size_t i = 0; i < n; ++i) out[i] = bf16_of(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

}  // namespace hemiola
