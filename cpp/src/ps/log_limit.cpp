#include "ps/log_limit.h"

namespace hemiola::ps {

std::string LogLimit::admit(const std::string& message, Clock::time_point now) {
  if (!started_ || now - start_ >= window_) {
    started_ = true;
    start_ = now;
    printed_ = 0;
  }
  if (printed_ >= lines_) {
    ++dropped_;
    return {};
  }
  ++printed_;
  if (dropped_ == 0) return message;
  const std::string summary = "(" + std::to_string(dropped_) + " more like it not shown) ";
  dropped_ = 0;
  return summary + message;
}

}  // namespace hemiola::ps
