#include "core/timeline.h"

#include <map>
#include <sstream>

namespace hemiola {

namespace {
std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}
}  // namespace

void Timeline::record(const std::string& lane, const std::string& name,
                      const std::string& category, int64_t start_us, int64_t end_us) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({lane, name, category, start_us, end_us});
}

std::string Timeline::json(int rank) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<std::string, int> lanes;
  for (const auto& e : events_) lanes.emplace(e.lane, static_cast<int>(lanes.size()));
  std::ostringstream out;
  out << "{\"traceEvents\":[";
  bool first = true;
  auto sep = [&] {
    if (!first) out << ",";
    first = false;
  };
  sep();
  out << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << rank
      << ",\"args\":{\"name\":\"rank " << rank << "\"}}";
  for (const auto& [lane, tid] : lanes) {
    sep();
    out << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << rank << ",\"tid\":" << tid
        << ",\"args\":{\"name\":\"" << escape(lane) << "\"}}";
  }
  for (const auto& e : events_) {
    sep();
    out << "{\"ph\":\"X\",\"pid\":" << rank << ",\"tid\":" << lanes.at(e.lane) << ",\"name\":\""
        << escape(e.name) << "\",\"cat\":\"" << escape(e.category) << "\",\"ts\":" << e.start_us
        << ",\"dur\":" << (e.end_us - e.start_us) << "}";
  }
  out << "]}";
  return out.str();
}

}  // namespace hemiola
