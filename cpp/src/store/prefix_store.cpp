#include "hemiola/status.h"
#include "hemiola/store.h"

namespace hemiola {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  HEMIOLA_CHECK(base_ != nullptr, "PrefixStore needs a base store");
}

void PrefixStore::set(const std::string& key, const std::string& value) {
  base_->set(prefix_ + "/" + key, value);
}

std::string PrefixStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return base_->get(prefix_ + "/" + key, timeout);
}

bool PrefixStore::check(const std::string& key) { return base_->check(prefix_ + "/" + key); }

}  // namespace hemiola
