#include "hemiola/build_config.h"
#include "hemiola/hemiola.h"

#if HEMIOLA_CUDA_ENABLED
#include "cuda/device.h"
#endif
#if HEMIOLA_NCCL_ENABLED
#include "comm/nccl_library.h"
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
#if HEMIOLA_NCCL_ENABLED
  // Loaded for the report and closed again: no library stays open on behalf
  // of a process that only asked what the build contains.
  const comm::NcclLibrary nccl;
  if (nccl.loaded()) {
    out += "nccl: yes (" + nccl.version() + " from " + nccl.path() + "; built against " +
           comm::nccl_version_string(NCCL_VERSION_CODE) + ")\n";
  } else {
    out += "nccl: no (" + nccl.reason() + ")\n";
  }
#else
  out += "nccl: no (" HEMIOLA_NCCL_REASON ")\n";
#endif
  out += HEMIOLA_CUDA_ENABLED
             ? "cuda tensors: yes (gpu_backend 'nccl', or 'gloo' staged through pinned memory)\n"
             : "cuda tensors: refused (no CUDA in this build)\n";
  return out;
}

}  // namespace hemiola
