// Completion handle of an operation submitted to the engine.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "hemiola/export.h"

namespace hemiola {

namespace detail {
// Shared between the submitting thread and the engine thread that runs the
// operation. Invariant: once `done` is true, `error` never changes.
struct HandleState {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  // Mirrors `done` for waiters that poll briefly before sleeping.
  std::atomic<bool> done_flag{false};
  std::exception_ptr error;
  std::string description;  // what the operation is, for error messages
  uint64_t sequence = 0;    // position in the engine's issue order
  uint64_t failure_sequence = 0;  // the operation whose failure this one reports
  // Called once, on the waiting thread, when the operation failed on the
  // transport; returns extra diagnosis (e.g. which ranks are missing).
  std::function<std::string(uint64_t)> diagnose;
  bool diagnosed = false;
};
}  // namespace detail

class HEMIOLA_API Handle {
 public:
  Handle() = default;
  explicit Handle(std::shared_ptr<detail::HandleState> state) : state_(std::move(state)) {}

  bool valid() const { return state_ != nullptr; }
  // True once the operation has finished (successfully or not).
  bool done() const;
  // Blocks until done; rethrows the operation's error, if any.
  void wait() const;
  // Blocks at most `timeout`; returns done(). Does not throw on failure.
  bool wait_for(std::chrono::milliseconds timeout) const;
  const std::string& description() const;
  // Position in the engine's issue order.
  uint64_t sequence() const;

 private:
  std::shared_ptr<detail::HandleState> state_;
};

}  // namespace hemiola
