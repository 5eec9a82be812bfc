// Entry points of the binding files, called from module.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <utility>

#include "hemiola/config.h"
#include "hemiola/optimizer.h"
#include "hemiola/status.h"

namespace hemiola::python {

// `result` as a Python object that keeps `owner` alive, which is what
// py::keep_alive<0, 1>() does. Done by hand because pybind11 3.1 runs that
// policy's post-call hook also after the arguments failed to convert, on its
// "try the next overload" sentinel instead of a result: a bad argument (a
// bucket size of 2^64 bytes, a float for an integer) crashed the process
// instead of raising TypeError.
template <typename T>
pybind11::object keeping_alive(T&& result, pybind11::handle owner) {
  pybind11::object out = pybind11::cast(std::forward<T>(result));
  pybind11::detail::keep_alive_impl(out, owner);
  return out;
}

// The square roots of the CPU Adam step from their addresses (0: std::sqrt),
// as hemiola.torch_sqrt finds them in torch.
inline VectorSqrt vector_sqrt(std::uintptr_t f32, std::uintptr_t f64) {
  VectorSqrt roots;
  roots.f32 = reinterpret_cast<VectorSqrtF32>(f32);
  roots.f64 = reinterpret_cast<VectorSqrtF64>(f64);
  return roots;
}

// The Compression of a Python code: one the engine's table lists.
inline Compression compression_of(int code) {
  for (const Coding& coding : codings()) {
    if (static_cast<int>(coding.compression) == code) return coding.compression;
  }
  HEMIOLA_CHECK(false, "unknown compression code ", code);
  return Compression::kNone;
}

void bind_engine(pybind11::module_& m);
void bind_cluster(pybind11::module_& m);
void bind_ps(pybind11::module_& m);
void bind_optim(pybind11::module_& m);
void bind_updater(pybind11::module_& m);
void bind_streamer(pybind11::module_& m);
// Only in builds with CUDA (HEMIOLA_CUDA_ENABLED).
void bind_cuda(pybind11::module_& m);
}  // namespace hemiola::python
