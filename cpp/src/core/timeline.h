// Timeline of engine events, exported as Chrome trace-event JSON (open it in
// chrome://tracing or https://ui.perfetto.dev). Recording is off unless
// EngineOptions::timeline is set; when off, record() is a single branch.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace hemiola {

class Timeline {
 public:
  explicit Timeline(bool enabled) : enabled_(enabled), origin_(std::chrono::steady_clock::now()) {}

  bool enabled() const { return enabled_; }
  // Microseconds since the engine started.
  int64_t now_us() const {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now() - origin_)
        .count();
  }
  // A complete event ("ph":"X") on `lane` (a row in the viewer).
  void record(const std::string& lane, const std::string& name, const std::string& category,
              int64_t start_us, int64_t end_us);
  std::string json(int rank) const;

 private:
  struct Event {
    std::string lane, name, category;
    int64_t start_us, end_us;
  };
  bool enabled_;
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

}  // namespace hemiola
