#include "engine/wire/wire_thread.h"

#include "hemiola/status.h"

namespace hemiola {

WireThread::WireThread(Communicator& comm, Timeline& timeline, Diagnose diagnose)
    : comm_(comm), timeline_(timeline), diagnose_(std::move(diagnose)), thread_([this] { loop(); }) {}

WireThread::~WireThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (auto& item : queue_) {
    finish(*item.state, std::make_exception_ptr(Error(
                            ErrorCode::kAborted, "engine shut down before '" +
                                                     item.state->description + "' ran")));
  }
}

Handle WireThread::submit(std::shared_ptr<Work> work) {
  auto state = std::make_shared<detail::HandleState>();
  state->description = work->describe();
  state->diagnose = diagnose_;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    HEMIOLA_CHECK(!stopping_, "engine is shutting down");
    state->sequence = next_sequence_++;
    queue_.push_back({std::move(work), state});
  }
  cv_.notify_one();
  return Handle(state);
}

void WireThread::finish(detail::HandleState& state, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.error = std::move(error);
    state.done = true;
  }
  state.done_flag.store(true, std::memory_order_release);
  state.cv.notify_all();
}

void WireThread::loop() {
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    if (failed_) {
      item.state->failure_sequence = failed_sequence_;
      error = std::make_exception_ptr(
          Error(failed_code_, "'" + item.state->description +
                                  "' was not run because the engine failed earlier: " +
                                  failed_message_));
    } else {
      try {
        item.work->run(comm_, timeline_);
      } catch (const Error& e) {
        // Re-describe: the work knows where it was when it failed.
        failed_code_ = e.code();
        failed_message_ = item.work->describe() + ": " + e.what();
      } catch (const std::exception& e) {
        failed_code_ = ErrorCode::kInternal;
        failed_message_ = item.work->describe() + ": " + e.what();
      }
      if (!failed_message_.empty()) {
        failed_ = true;
        // Nothing runs on this lane after a failure: close its connections
        // so that peers blocked on this rank fail now and reach the
        // diagnosis (which ranks are missing) while this rank waits in it.
        comm_.abort();
        failed_sequence_ = item.state->sequence;
        item.state->failure_sequence = failed_sequence_;
        error = std::make_exception_ptr(Error(failed_code_, failed_message_));
      }
    }
    finish(*item.state, error);
  }
}

}  // namespace hemiola
