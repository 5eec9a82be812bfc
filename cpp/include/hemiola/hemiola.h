// Umbrella header for embedding the hemiola engine in a C++ program.
#pragma once

#include "hemiola/build_config.h"
#include "hemiola/config.h"
#include "hemiola/engine.h"
#include "hemiola/handle.h"
#include "hemiola/network.h"
#include "hemiola/optimizer.h"
#include "hemiola/reducer.h"
#include "hemiola/status.h"
#include "hemiola/store.h"
#include "hemiola/streamer.h"
#include "hemiola/tensor.h"
#include "hemiola/updater.h"

namespace hemiola {
// One line per feature: what this build compiled in, and why not.
HEMIOLA_API std::string build_info();
}  // namespace hemiola
