// The engine's floating dtypes as element types, and the one switch from a
// run-time DType to them. Every loop over a buffer of a floating dtype
// (dtype_math.cpp, the optimizer steps, the gradient norms, streaming's
// merge, the preview's coding) is written once, generic in the element type,
// and instantiated here per dtype:
//
//   for_floating(dtype, [&](auto e) {
//     using E = decltype(e);
//     auto* x = static_cast<typename E::Storage*>(data);
//     for (size_t i = 0; i < n; ++i) x[i] = E::store(E::load(x[i]) * f);
//   }, "cannot scale dtype ", dtype);
//
// An element type says how a stored value is read (load: exact, to the type
// the dtype is computed in), how a computed value is written back (store:
// round to nearest, ties to even; NaN stays NaN), and so what one rounding to
// the dtype is (round). The half types are computed in float32, as torch's
// CPU ops compute them; float64 in double; float32 in float. A place that
// computes wider (the gradient norms and streaming accumulate in double)
// widens the loaded value itself and narrows to Compute before store.
//
// Everything here is inline and small, so a loop written against it compiles
// in the file that writes it, with that file's flags (the optimizer's
// -fno-math-errno -ffp-contract=off and its x86-64-v3 clone): no arithmetic
// loop lives here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/half.h"
#include "hemiola/status.h"
#include "hemiola/tensor.h"

namespace hemiola {

// Internal linkage, deliberately: each file that includes this gets these as
// its own helpers, so the compiler weighs inlining them into that file's loops
// as it did the per-file copies they replace (as ordinary inline functions,
// GCC inlined the float16 rounding differently and the optimizer's half-type
// steps ran up to a tenth slower, measured).
namespace {
namespace element {

// How each dtype's bits become a Compute value and back.
struct Float32Bits {
  static constexpr DType dtype = DType::kFloat32;
  using Storage = float;
  using Compute = float;
  static Compute load(Storage s) { return s; }
  static Storage store(Compute c) { return c; }
};
struct Float64Bits {
  static constexpr DType dtype = DType::kFloat64;
  using Storage = double;
  using Compute = double;
  static Compute load(Storage s) { return s; }
  static Storage store(Compute c) { return c; }
};
struct Float16Bits {
  static constexpr DType dtype = DType::kFloat16;
  using Storage = uint16_t;
  using Compute = float;
  static Compute load(Storage s) { return fp16_to_float(s); }
  static Storage store(Compute c) { return float_to_fp16(c); }
};
struct BFloat16Bits {
  static constexpr DType dtype = DType::kBFloat16;
  using Storage = uint16_t;
  using Compute = float;
  static Compute load(Storage s) { return bf16_to_float(s); }
  static Storage store(Compute c) { return float_to_bf16(c); }
};

// What every element type derives from its bits.
template <typename Bits>
struct Floating : Bits {
  using typename Bits::Compute;
  using typename Bits::Storage;
  // Stored narrower than computed (float16, bfloat16).
  static constexpr bool kHalf = !std::is_same_v<Storage, Compute>;

  // c rounded to the dtype, as storing it would (identity for float32 and
  // float64, whose arithmetic already rounds so).
  static Compute round(Compute c) { return Bits::load(Bits::store(c)); }
  // Element i of a buffer of this dtype, and writing one.
  static Compute at(const void* data, size_t i) {
    return Bits::load(static_cast<const Storage*>(data)[i]);
  }
  static void put(void* data, size_t i, Compute c) {
    static_cast<Storage*>(data)[i] = Bits::store(c);
  }
};

}  // namespace element

using Float32 = element::Floating<element::Float32Bits>;
using Float64 = element::Floating<element::Float64Bits>;
using Float16 = element::Floating<element::Float16Bits>;
using BFloat16 = element::Floating<element::BFloat16Bits>;

namespace element {
// A part of a refusal: a DType is spelled by its name (only once it throws).
inline const char* spelled(DType dtype) { return dtype_name(dtype); }
template <typename T>
const T& spelled(const T& part) {
  return part;
}
}  // namespace element

// Calls body(E{}) with the element type E of `dtype` and returns what it
// returns; for a dtype that is not floating, throws kInvalidArgument with the
// message `refusal...` (a DType among its parts is written as its name).
// Always inlined, so a body that is inlined too compiles into its caller
// (the optimizer's per-architecture clones).
template <typename Body, typename... Refusal>
__attribute__((always_inline)) inline auto for_floating(DType dtype, Body&& body,
                                                        const Refusal&... refusal)
    -> decltype(body(Float32{})) {
  switch (dtype) {
    case DType::kFloat32: return body(Float32{});
    case DType::kFloat64: return body(Float64{});
    case DType::kFloat16: return body(Float16{});
    case DType::kBFloat16: return body(BFloat16{});
    default: break;
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, element::spelled(refusal)...);
}

}  // namespace
}  // namespace hemiola
