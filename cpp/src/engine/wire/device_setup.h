// Making a CUDA device's stream and communicator ready before its first
// reduction (the device buckets then find them in the engine's Devices).
#pragma once

namespace hemiola {

class Scheduler;

// Creates the engine's stream and communicator for CUDA device `device`, on
// the main wire's thread (a collective, in submission order); returns once done.
void set_up_device(Scheduler& engine, int device);

}  // namespace hemiola
