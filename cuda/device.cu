#include <cuda_runtime.h>

#include "device.h"

namespace hemiola::cuda {

int device_count(std::string* reason) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    // Without a GPU driver this is cudaErrorInsufficientDriver (35): "no GPU".
    if (reason) *reason = cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  if (count == 0 && reason) *reason = "no CUDA device";
  return count;
}

}  // namespace hemiola::cuda
