// The wire floor's face: what the floors above it (the reducer, streaming)
// need of the engine that hosts them, and nothing more: the engine's
// options, its wires (a communicator and a thread each, wire_thread.h,
// running work in submission order), the CUDA devices, and one broadcast.
// The Engine (engine/engine_impl.h) implements it; no floor below the
// engine sees the Engine itself.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "comm/devices.h"
#include "engine/wire/wire_thread.h"
#include "hemiola/config.h"
#include "hemiola/handle.h"
#include "hemiola/tensor.h"

namespace hemiola {

class Scheduler {
 public:
  // The engine's own wire: every collective of the engine that is not on a
  // wire of its own goes through it, in one order.
  static constexpr size_t kMainWire = 0;

  virtual ~Scheduler() = default;
  virtual const EngineOptions& options() const = 0;
  // A wire of its own for `name` (a second communicator and wire
  // thread, so that its work is never queued behind the main wire's). The
  // first call for a name connects it: a rendezvous, so every rank must make
  // it at the same point; later calls return the same wire at once.
  virtual size_t connect_wire(const std::string& name) = 0;
  // Runs `work` on `wire`'s thread after the work submitted to it
  // before (the same order on every rank).
  virtual Handle submit(size_t wire, std::shared_ptr<Work> work) = 0;
  // CUDA devices' streams and communicators (their wire's thread only).
  virtual Devices& devices() = 0;
  // A broadcast on the main wire (the reducer's plan rebuild).
  virtual Handle broadcast(const TensorRef& tensor, int root) = 0;
};

}  // namespace hemiola
