#include "engine/wire/device_setup.h"

#include <memory>
#include <string>

#include "comm/devices.h"
#include "cuda/device.h"
#include "engine/wire/scheduler.h"

namespace hemiola {

namespace {

// Creates the engine's stream and communicator for a CUDA device.
class DeviceSetup final : public Work {
 public:
  DeviceSetup(Scheduler& engine, int device) : engine_(engine), device_(device) {}
  void run(Communicator&, Timeline&) override {
    cuda::set_device(device_);
    engine_.devices().get(device_);
  }
  std::string describe() const override {
    return "communicator setup for CUDA device " + std::to_string(device_);
  }

 private:
  Scheduler& engine_;
  int device_;
};

}  // namespace

void set_up_device(Scheduler& engine, int device) {
  engine.submit(Scheduler::kMainWire, std::make_shared<DeviceSetup>(engine, device)).wait();
}

}  // namespace hemiola
