// The refusal of a build without CUDA. Every X.cu of the engine (this floor's
// device.cu, the kernels beside the floors that launch them) has a stand-in
// X_unavailable.cpp, compiled instead of it when nvcc was not found at build
// time, whose functions call this, so engine code needs no #if around its
// device path.
#pragma once

namespace hemiola::cuda {

// Throws hemiola::Error (kInvalidArgument) saying the build lacks CUDA and
// what to do.
[[noreturn]] void unavailable();

}  // namespace hemiola::cuda
