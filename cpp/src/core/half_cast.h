// Bulk conversions between float32 and the half types (float16, bfloat16),
// for wire compression and for summing half-precision buckets. Each result is
// the same, bit for bit, as the element-wise functions of dtype_math.h
// (round to nearest, ties to even); these are the fast paths: float16 through
// the CPU's F16C instructions where it has them (checked at run time),
// bfloat16 in integer arithmetic the compiler vectorises.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hemiola/tensor.h"

namespace hemiola {

// out[i] = half(float(half(in[i])) / divisor): cast, then divide in the half
// type (divisor 1: the cast alone). `half` is kFloat16 or kBFloat16.
void floats_to_halves(DType half, const float* in, uint16_t* out, size_t n, float divisor);
// out[i] = float(in[i]).
void halves_to_floats(DType half, const uint16_t* in, float* out, size_t n);
// out[i] = half(float(a[i]) + float(b[i])) (out may alias a or b).
void sum_halves(DType half, uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n);

}  // namespace hemiola
