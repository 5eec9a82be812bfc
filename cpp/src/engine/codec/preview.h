// The preview: a low-precision estimate of a bucket's average that a reducer
// (ReducerOptions::preview) all-reduces ahead of the full-precision one, so
// that `decoupled` can take its approximate step from information every rank
// shares instead of from its own gradient alone.
//
// Each rank codes its gradient g as int8 codes q = clamp(rint(g / s), -L, L)
// with a scale s per block of kPreviewBlock elements of the bucket that every
// rank knows (derived from an earlier averaged gradient, so no collective is
// needed to agree on it) and L = floor(127 / world), so the sum of the codes
// over all ranks fits an int8 exactly: the codes are summed by a uint8
// all-reduce, whose wrap-around arithmetic is exact modulo 256. The estimate
// a rank gets is
//
//     e = g - s*q + s * sum_ranks(q) / world
//
// its own gradient with its own coding error, plus the coded average. Its
// mean over the ranks is exactly the average of g (the coding errors cancel),
// and its distance from the average is the coding error, centred: small
// where the codes resolve g, and never worse than the rank's own gradient
// where they do not (a clipped or zero-scale element keeps g). One byte per
// element travels, a quarter of float32's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hemiola/tensor.h"

namespace hemiola {

// Elements of a bucket that share one scale. Per block rather than per
// tensor: an embedding's rows, or a layer's biases, differ in magnitude by
// orders, and one scale for all of them leaves most of them uncoded.
constexpr size_t kPreviewBlock = 64;

// The largest code magnitude L for `world` ranks (0: no preview possible).
int preview_levels(int world);

// How wide the codes span, in RMS of a block's average: ±5 RMS of one
// rank's gradient, taking a rank's gradient to be the average plus noise
// that averaging over `world` ranks shrinks by sqrt(world). A rank's value
// beyond the span is clipped, and its estimate keeps the excess of its own
// gradient: on the LM of bench/convergence.py (4 ranks, small batches) a
// span of 3 RMS of the average clipped so often that the estimates were
// 0.5-0.8 of the average's norm away from it; 10 (this at 4 ranks) brought
// that to 0.2-0.3 and the held-out loss to the exact run's
// (bench/approximation_model.py --range; docs/schedules.md).
double preview_range(int world);

// The scales of a bucket of n elements whose averaged gradient (of an
// earlier iteration) is `averaged`, for `world` ranks: per block, codes span
// +-preview_range(world) RMS of that block's average, in preview_levels(world)
// steps each way. 0 where that average is zero or not finite (those elements
// are then not coded: their estimate is the rank's own gradient).
// `scales` holds ceil(n / kPreviewBlock) values.
void preview_scales(DType dtype, const void* averaged, size_t n, int world, float* scales);

// For the n elements at `offset` of a bucket (`scales` are the bucket's):
// codes <- clamp(rint(g / s), -levels, levels); estimate <- g - s*codes
// (g itself where s is 0 or g is not finite, with code 0).
void preview_encode(DType dtype, const void* grad, size_t offset, size_t n, const float* scales,
                    int levels, int8_t* codes, void* estimate);

// For the n elements at `offset` of a bucket: estimate += s * sums / world,
// the sums read as int8 (the codes summed over the ranks modulo 256).
void preview_decode(DType dtype, const int8_t* sums, size_t offset, size_t n,
                    const float* scales, int world, void* estimate);

// Adds sum((estimate - averaged)^2) to *distance and sum(averaged^2) to
// *norm over n elements: how far a rank's estimate was from the average.
void preview_distance(DType dtype, const void* estimate, const void* averaged, size_t n,
                      double* distance, double* norm);

}  // namespace hemiola
