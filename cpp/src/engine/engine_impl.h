// Engine internals shared by the engine and the reducers it creates.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "comm/communicator.h"
#include "comm/devices.h"
#include "engine/reducer/scheduler.h"
#include "core/timeline.h"
#include "hemiola/config.h"
#include "hemiola/engine.h"
#include "hemiola/handle.h"
#include "hemiola/store.h"

namespace hemiola {

class EngineImpl {
 public:
  EngineImpl(const EngineOptions& options, std::shared_ptr<Store> store);
  ~EngineImpl();

  const EngineOptions& options() const { return options_; }
  Communicator& comm() { return *comm_; }
  // CUDA devices' streams and communicators (scheduler thread only).
  Devices& devices() { return *devices_; }
  Timeline& timeline() { return timeline_; }
  Handle submit(std::shared_ptr<Work> work) { return scheduler_->submit(std::move(work)); }
  // The preview lane (ReducerOptions::preview): a communicator and scheduler
  // thread of their own, so that an iteration's previews are not queued
  // behind the previous iteration's full reductions. Connecting is a
  // rendezvous, made once, at the same point on every rank (the first
  // construction of a reducer with a preview); later calls return at once.
  // Its own submission order is the same on every rank.
  void connect_preview_lane();
  Handle submit_preview(std::shared_ptr<Work> work);

  // Single collectives on caller-owned memory, through the scheduler.
  Handle all_reduce(const TensorRef& tensor, ReduceOp op);
  Handle broadcast(const TensorRef& tensor, int root);
  Handle all_gather(const TensorRef& input, const TensorRef& output);
  Handle barrier();

 private:
  EngineOptions options_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<Store> rendezvous_;  // store_, or a private one for a single rank
  Timeline timeline_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Devices> devices_;
  std::unique_ptr<Scheduler> scheduler_;  // destroyed first: joins before comm_ goes
  std::unique_ptr<Communicator> preview_comm_;    // the preview lane, once used
  std::unique_ptr<Scheduler> preview_scheduler_;
  std::mutex preview_mutex_;  // guards making the preview lane

  // A scheduler over `comm`; its failures name missing ranks through the
  // store under "hemiola_failure/<lane><sequence>".
  std::unique_ptr<Scheduler> make_scheduler(Communicator& comm, const std::string& lane);
};

}  // namespace hemiola
