// A wire's thread: one engine thread over one communicator that runs
// submitted work strictly in submission order. Every collective of a wire
// goes through it, so the issue order on each rank is the submission order --
// identical across ranks as long as every rank submits the same work in the
// same order.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/communicator.h"
#include "core/timeline.h"
#include "hemiola/handle.h"
#include "hemiola/status.h"

namespace hemiola {

// A unit of engine work. run() is called once on its wire's thread and
// throws on failure.
class Work {
 public:
  virtual ~Work() = default;
  virtual void run(Communicator& comm, Timeline& timeline) = 0;
  // What this work is (and, after a failure, where it was), for messages.
  virtual std::string describe() const = 0;
};

class WireThread {
 public:
  using Diagnose = std::function<std::string(uint64_t)>;

  WireThread(Communicator& comm, Timeline& timeline, Diagnose diagnose);
  // Fails all queued work with kAborted and joins the thread.
  ~WireThread();

  Handle submit(std::shared_ptr<Work> work);

 private:
  struct Item {
    std::shared_ptr<Work> work;
    std::shared_ptr<detail::HandleState> state;
  };
  void loop();
  static void finish(detail::HandleState& state, std::exception_ptr error);

  Communicator& comm_;
  Timeline& timeline_;
  Diagnose diagnose_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;  // guarded by mutex_
  bool stopping_ = false;   // guarded by mutex_
  uint64_t next_sequence_ = 0;
  // Sticky: once any work failed, the transport's state is unknown (a
  // collective may be half done on some ranks), so every later work fails
  // with this error instead of risking mismatched collectives.
  bool failed_ = false;
  ErrorCode failed_code_ = ErrorCode::kInternal;
  std::string failed_message_;
  uint64_t failed_sequence_ = 0;
  std::thread thread_;  // last: starts after everything above is initialised
};

}  // namespace hemiola
