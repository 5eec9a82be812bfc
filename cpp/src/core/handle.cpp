#include "hemiola/handle.h"

#include <thread>

#include "hemiola/status.h"

namespace hemiola {

bool Handle::done() const {
  HEMIOLA_CHECK(state_ != nullptr, "Handle::done on an empty handle");
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

bool Handle::wait_for(std::chrono::milliseconds timeout) const {
  HEMIOLA_CHECK(state_ != nullptr, "Handle::wait_for on an empty handle");
  std::unique_lock<std::mutex> lock(state_->mutex);
  return state_->cv.wait_for(lock, timeout, [&] { return state_->done; });
}

void Handle::wait() const {
  HEMIOLA_CHECK(state_ != nullptr, "Handle::wait on an empty handle");
  // Small collectives finish within tens of microseconds: poll briefly
  // (yielding the core) before paying for a sleep and a wake-up.
  const auto poll_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
  while (!state_->done_flag.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < poll_until) {
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (!state_->error) return;
  // A transport failure: find out, once, which ranks are missing. This runs
  // on the waiting (user) thread, never on an engine thread, because it may
  // call into a user-provided store.
  try {
    std::rethrow_exception(state_->error);
  } catch (const Error& e) {
    const bool transport = e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kCommFailure;
    if (transport && state_->diagnose && !state_->diagnosed) {
      state_->diagnosed = true;
      auto diagnose = state_->diagnose;
      const uint64_t sequence = state_->failure_sequence;
      lock.unlock();
      const std::string extra = diagnose(sequence);
      lock.lock();
      state_->error = std::make_exception_ptr(Error(e.code(), std::string(e.what()) + extra));
    }
  }
  std::rethrow_exception(state_->error);
}

uint64_t Handle::sequence() const {
  HEMIOLA_CHECK(state_ != nullptr, "Handle::sequence on an empty handle");
  return state_->sequence;
}

const std::string& Handle::description() const {
  HEMIOLA_CHECK(state_ != nullptr, "Handle::description on an empty handle");
  return state_->description;
}

}  // namespace hemiola
