// Plain C++ view of the CUDA runtime, for code compiled without nvcc.
#pragma once

#include <string>

namespace hemiola::cuda {

// Number of usable CUDA devices; 0 with `reason` filled when there are none
// (no driver, no device, ...). Never throws.
int device_count(std::string* reason);

}  // namespace hemiola::cuda
