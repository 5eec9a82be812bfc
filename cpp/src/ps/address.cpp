#include "ps/address.h"

#include <unistd.h>

#include "comm/network.h"
#include "hemiola/status.h"

namespace hemiola::ps {

namespace {
constexpr char kStartupFailed[] = "failed to start: ";
}  // namespace

std::string bind_address(const BindSpec& spec) {
  if (!spec.iface.empty()) {
    const std::string address = address_of_interface(spec.iface);
    HEMIOLA_CHECK(!address.empty(), "network interface '", spec.iface,
                  "' has no usable IP address (check GLOO_SOCKET_IFNAME or the iface option)");
    return address;
  }
  if (!spec.hostname.empty()) return spec.hostname;
  if (std::string a = local_address_reaching(spec.master_addr); !a.empty()) return a;
  if (spec.alone) return "127.0.0.1";
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "127.0.0.1";
  return name;
}

std::string address_key(int server_index) { return detail::concat("ps/s", server_index, "/address"); }

std::string startup_failure(const std::string& why) { return kStartupFailed + why; }

ServerAddress published_address(Store& store, int server_index, std::chrono::milliseconds timeout,
                                const std::string& server_name) {
  const std::string published = store.get(address_key(server_index), timeout);
  if (published.rfind(kStartupFailed, 0) == 0) {  // "failed to start: why"
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, server_name, " ", published,
                  " (this worker cannot train without it)");
  }
  const auto space = published.rfind(' ');
  HEMIOLA_CHECK(space != std::string::npos, "the store holds no valid address for ", server_name,
                ": '", published, "'");
  return ServerAddress{published.substr(0, space), published.substr(space + 1)};
}

}  // namespace hemiola::ps
