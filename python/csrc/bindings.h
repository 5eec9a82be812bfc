// Entry points of the binding files, called from module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace hemiola::python {
void bind_engine(pybind11::module_& m);
void bind_cluster(pybind11::module_& m);
void bind_ps(pybind11::module_& m);
void bind_optim(pybind11::module_& m);
void bind_updater(pybind11::module_& m);
// Only in builds with CUDA (HEMIOLA_CUDA_ENABLED).
void bind_cuda(pybind11::module_& m);
}  // namespace hemiola::python
