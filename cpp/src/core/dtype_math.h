// Element-wise arithmetic on raw buffers of the engine's floating dtypes: the
// reduction function handed to the collectives, and in-place scaling used for
// averaging. Half types are computed in float32 and rounded back per element
// (core/half.h's conversions, which this header hands on).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/half.h"
#include "hemiola/tensor.h"

namespace hemiola {

// out[i] = a[i] + b[i] for n elements of `dtype` (out may alias a or b).
void sum_into(DType dtype, void* out, const void* a, const void* b, size_t n);
// data[i] *= factor for n elements of `dtype`.
void scale_in_place(DType dtype, void* data, size_t n, double factor);

}  // namespace hemiola
