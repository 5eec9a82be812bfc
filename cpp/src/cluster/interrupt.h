// Stopping a long simulation from outside: Ctrl-C in Python, a deadline or a
// cancel button in a C++ program.
#pragma once

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>

namespace hemiola::cluster {

// Asked every few milliseconds of a run whether to stop; true stops it with
// Interrupted. It may instead throw its own exception (the Python bindings
// raise KeyboardInterrupt that way), which leaves simulate() the same way.
// An empty StopCheck is never called.
using StopCheck = std::function<bool()>;

class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Calls a StopCheck from a simulator's event loop, at most once per interval
// of wall time: often enough to answer within a blink, rarely enough that
// checking (which takes the GIL in Python) costs nothing measurable.
class StopPoller {
 public:
  explicit StopPoller(const StopCheck& check) : check_(check) {}

  // Call once per event-loop step; throws Interrupted when the check says stop.
  void poll(long long events, double now_ms) {
    if (should_stop(events)) {
      throw Interrupted("simulation interrupted after " + std::to_string(events) +
                        " events, at simulated time " + std::to_string(now_ms / 1000.0) + " s");
    }
  }

  // Call once per step of any loop: the check's answer, asked at most once
  // per 10 ms (false in between).
  bool should_stop(long long steps) {
    // Reading the clock costs tens of nanoseconds, an event step about a
    // microsecond: look at it only every 64 steps.
    if (!check_ || (steps & 63) != 0) return false;
    const auto t = std::chrono::steady_clock::now();
    if (t < next_) return false;
    next_ = t + std::chrono::milliseconds(10);
    return check_();
  }

 private:
  const StopCheck& check_;
  std::chrono::steady_clock::time_point next_{};
};

}  // namespace hemiola::cluster
