#include "hemiola/status.h"

#include <cstring>

#include "hemiola/tensor.h"

namespace hemiola {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kCommFailure: return "communication failure";
    case ErrorCode::kAborted: return "aborted";
    case ErrorCode::kInternal: return "internal error";
    case ErrorCode::kNotFinite: return "not finite";
  }
  return "unknown error";
}

namespace detail {
void throw_error(ErrorCode code, const char* file, int line, const std::string& message) {
  // Keep the path short: from "cpp/src/..." on.
  const char* short_file = std::strstr(file, "cpp/src/");
  throw Error(code, concat(message, " [", short_file ? short_file : file, ":", line, "]"));
}
}  // namespace detail

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown dtype code ", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

bool is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

}  // namespace hemiola
