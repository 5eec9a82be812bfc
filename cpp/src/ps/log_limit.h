// A bound on how many lines a flood of events may print: a server refusing
// hostile connections must not spend its time (or a lock) writing stderr.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace hemiola::ps {

class LogLimit {
 public:
  using Clock = std::chrono::steady_clock;

  // At most `lines` lines per `window`; the rest are counted, and the first
  // line printed after a window that dropped some says how many.
  LogLimit(int lines, Clock::duration window) : lines_(lines), window_(window) {}

  // The text to print for `message` at `now` (empty: print nothing). Not
  // thread-safe: call it under the lock that guards the event.
  std::string admit(const std::string& message, Clock::time_point now);

 private:
  const int lines_;
  const Clock::duration window_;
  Clock::time_point start_{};
  bool started_ = false;
  int printed_ = 0;
  int64_t dropped_ = 0;
};

}  // namespace hemiola::ps
