#include "comm/gloo_setup.h"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include "comm/network.h"
#include "hemiola/status.h"

namespace hemiola {

namespace {

// Gloo's rendezvous talks to a gloo::rendezvous::Store; forward to ours.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(hemiola::Store& store, std::chrono::milliseconds timeout)
      : store_(store), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string value = store_.get(key, timeout_);
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const auto& key : keys) store_.get(key, timeout);
  }

 private:
  hemiola::Store& store_;
  std::chrono::milliseconds timeout_;
};

std::string default_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "127.0.0.1";
  return name;
}

}  // namespace

std::shared_ptr<gloo::transport::Device> make_gloo_device(const BindSpec& spec,
                                                          std::string* address) {
  gloo::transport::tcp::attr attr;
  std::string where;
  if (!spec.iface.empty()) {
    attr.iface = spec.iface;
    where = "iface " + spec.iface;
  } else {
    std::string host = spec.hostname;
    if (host.empty()) host = local_address_reaching(spec.master_addr);
    // Alone, nobody needs to reach us: loopback always binds.
    if (host.empty() && spec.alone) host = "127.0.0.1";
    if (host.empty()) host = default_hostname();
    attr.hostname = host;
    where = host;
  }
  if (address) *address = where;
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "cannot bind a Gloo TCP device on ", where, ": ",
                  e.what(), " (set GLOO_SOCKET_IFNAME or the iface option)");
  }
}

std::shared_ptr<gloo::Context> connect_gloo_context(
    int rank, int size, Store& store, std::shared_ptr<gloo::transport::Device> device,
    std::chrono::milliseconds timeout) {
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  GlooStoreAdapter adapter(store, timeout);
  try {
    context->connectFullMesh(adapter, device);
  } catch (const hemiola::Error&) {
    throw;  // store timeout: already says which key was missing
  } catch (const std::exception& e) {
    HEMIOLA_THROW(ErrorCode::kCommFailure, "rank ", rank, ": Gloo rendezvous failed: ", e.what());
  }
  return context;
}

}  // namespace hemiola
