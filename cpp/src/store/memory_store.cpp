#include "hemiola/status.h"
#include "hemiola/store.h"

namespace hemiola {

void MemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    values_[key] = value;
  }
  changed_.notify_all();
}

std::string MemoryStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool found =
      changed_.wait_for(lock, timeout, [&] { return values_.count(key) != 0; });
  if (!found) {
    HEMIOLA_THROW(ErrorCode::kTimeout, "store key '", key, "' was not set within ",
                  timeout.count(), " ms");
  }
  return values_[key];
}

bool MemoryStore::check(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return values_.count(key) != 0;
}

}  // namespace hemiola
