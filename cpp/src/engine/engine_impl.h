// Engine internals shared by the engine and the reducers it creates.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include <vector>

#include "comm/communicator.h"
#include "comm/devices.h"
#include "core/timeline.h"
#include "engine/wire/scheduler.h"
#include "engine/wire/wire_thread.h"
#include "hemiola/config.h"
#include "hemiola/engine.h"
#include "hemiola/handle.h"
#include "hemiola/store.h"

namespace hemiola {

// The composition root: the engine's wires (its main communicator and
// scheduler thread, and one more pair per wire a lane connects), devices and
// timeline; the reducers it makes see it only as their Scheduler.
class EngineImpl final : public Scheduler {
 public:
  EngineImpl(const EngineOptions& options, std::shared_ptr<Store> store);
  ~EngineImpl() override;

  const EngineOptions& options() const override { return options_; }
  Communicator& comm() { return *comm_; }
  Devices& devices() override { return *devices_; }
  Timeline& timeline() { return timeline_; }
  Handle submit(std::shared_ptr<Work> work) { return submit(kMainWire, std::move(work)); }
  // A wire's communicator rendezvouses under the store prefix "hemiola_<name>",
  // and its failures are diagnosed under "hemiola_failure/<name>/".
  size_t connect_wire(const std::string& name) override;
  Handle submit(size_t wire, std::shared_ptr<Work> work) override;

  // Single collectives on caller-owned memory, through the scheduler.
  Handle all_reduce(const TensorRef& tensor, ReduceOp op);
  Handle broadcast(const TensorRef& tensor, int root) override;
  Handle all_gather(const TensorRef& input, const TensorRef& output);
  Handle barrier();
  Handle reduce_scatter(const TensorRef& tensor, ReduceOp op);
  Handle all_gather_chunks(std::vector<TensorRef> segments, std::vector<size_t> bounds);
  Handle reduce_scatter_coded(const TensorRef& tensor, const TensorRef& residual,
                              Compression coding);

 private:
  EngineOptions options_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<Store> rendezvous_;  // store_, or a private one for a single rank
  Timeline timeline_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Devices> devices_;
  // Wire 0 is the main one (comm_); the others own their communicator.
  struct Wire {
    std::string name;
    std::unique_ptr<Communicator> comm;  // null for the main wire
    std::unique_ptr<WireThread> thread;
  };
  std::vector<Wire> wires_;  // guarded by wires_mutex_; schedulers joined first
  mutable std::mutex wires_mutex_;

  // A scheduler over `comm`; its failures name missing ranks through the
  // store under "hemiola_failure/<lane><sequence>".
  std::unique_ptr<WireThread> make_wire_thread(Communicator& comm, const std::string& lane);
};

}  // namespace hemiola
