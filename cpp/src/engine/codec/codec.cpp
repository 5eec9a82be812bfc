// The frame every coding shares (Codec::reduce), and the names of the
// codings as the table (factory.cpp, codings()) gives them.
#include "engine/codec/codec.h"

namespace hemiola {

// Storage → coding → storage, once per bucket: the copies into the bucket
// are in before any coding reads it, and its result is copied out (scaled
// by what send() returns) before the bucket is reused.
void Codec::reduce(BucketStorage& storage, size_t b, uint64_t iteration,
                   const std::vector<void*>& outs, Communicator& host) {
  storage.await_copies(b);
  const double scale = send(storage, b, iteration, host);
  storage.copy_out(b, outs, scale);
}

std::vector<const char*> coding_names(const std::function<bool(const Coding&)>& has) {
  std::vector<const char*> names;
  for (const Coding& c : codings()) {
    if (has(c)) names.push_back(c.name);
  }
  return names;
}

std::string listed(const std::vector<const char*>& names, const char* conjunction) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? std::string(" ") + conjunction + " " : ", ";
    out += names[i];
  }
  return out;
}

}  // namespace hemiola
