#include "hemiola/build_config.h"
#include "hemiola/hemiola.h"

#if HEMIOLA_CUDA_ENABLED
#include "device.h"
#endif

namespace hemiola {

std::string build_info() {
  std::string out;
  out += "version: " HEMIOLA_VERSION "\n";
  out += "compiler: " HEMIOLA_COMPILER "\n";
  out += "gloo: yes (" HEMIOLA_GLOO_VERSION ", CPU collectives over TCP)\n";
  out += std::string("cuda: ") + (HEMIOLA_CUDA_ENABLED ? "yes" : "no") + " (" HEMIOLA_CUDA_REASON ")\n";
#if HEMIOLA_CUDA_ENABLED
  std::string reason;
  const int devices = cuda::device_count(&reason);
  out += "cuda devices: " + std::to_string(devices) + (devices ? "" : " (" + reason + ")") + "\n";
#endif
  out += "nccl: no (the GPU/NCCL path is not built yet; CUDA tensors are refused)\n";
  return out;
}

}  // namespace hemiola
