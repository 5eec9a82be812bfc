// Non-owning tensor references: the only way tensors cross into the engine.
//
// The engine never owns or allocates user tensors; the caller keeps the memory
// alive until the engine says it is done with it (a Handle completes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hemiola/export.h"

namespace hemiola {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
};

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t index = -1;  // CUDA ordinal; -1 on CPU
};

// Size in bytes of one element.
HEMIOLA_API size_t dtype_size(DType dtype);
HEMIOLA_API const char* dtype_name(DType dtype);
// True for the dtypes that can be summed/averaged (the floating-point ones).
HEMIOLA_API bool is_floating(DType dtype);

// A CUDA stream (a cudaStream_t) as the engine's API takes it: a type of its
// own, so a data pointer never converts to it by accident. The default is
// the legacy default stream; CPU work ignores it.
struct StreamRef {
  void* handle = nullptr;
};

struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  size_t numel = 0;
  Device device{};

  size_t nbytes() const { return numel * dtype_size(dtype); }
};

// A gradient tensor as a reducer is made for it: what every rank must agree
// on before the first iteration.
struct GradSpec {
  DType dtype = DType::kFloat32;
  size_t numel = 0;
  std::string name;  // for error messages, e.g. "layer1.0.conv1.weight"
  // The tensor's first dimension (0: not a matrix). PowerSGD compression
  // views the gradient as rows x (numel / rows), as torch's hook does.
  size_t rows = 0;
};

}  // namespace hemiola
