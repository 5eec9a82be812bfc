#include "comm/network.h"

#include "hemiola/network.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>

namespace hemiola {

namespace {

// The numeric text of an IPv4 or IPv6 socket address; empty for other families.
std::string numeric_address(const sockaddr* addr) {
  const void* src = nullptr;
  if (addr->sa_family == AF_INET)
    src = &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr;
  else if (addr->sa_family == AF_INET6)
    src = &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr;
  char buf[INET6_ADDRSTRLEN] = {};
  if (src == nullptr || ::inet_ntop(addr->sa_family, src, buf, sizeof buf) == nullptr) return {};
  return buf;
}

// Calls `visit` with every IPv4 and IPv6 address of every local interface, in
// the order getifaddrs lists them, until it returns false.
void for_each_interface_address(const std::function<bool(const ifaddrs&)>& visit) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return;
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr) continue;
    const int family = ifa->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (!visit(*ifa)) break;
  }
  ::freeifaddrs(list);
}

}  // namespace

std::string local_address_reaching(const std::string& host) {
  if (host.empty()) return {};
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  if (::getaddrinfo(host.c_str(), "29500", &hints, &result) != 0 || result == nullptr) return {};
  std::string address;
  for (addrinfo* ai = result; ai != nullptr && address.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    // connect() on a UDP socket only selects a route and a source address.
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      sockaddr_storage local{};
      socklen_t len = sizeof local;
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0)
        address = numeric_address(reinterpret_cast<const sockaddr*>(&local));
    }
    ::close(fd);
  }
  ::freeaddrinfo(result);
  return address;
}

std::string interface_with_address(const std::string& address) {
  if (address.empty()) return {};
  std::string name;
  for_each_interface_address([&](const ifaddrs& ifa) {
    if (numeric_address(ifa.ifa_addr) == address) name = ifa.ifa_name;
    return name.empty();
  });
  return name;
}

std::string address_of_interface(const std::string& iface) {
  std::string v4, v6;
  for_each_interface_address([&](const ifaddrs& ifa) {
    if (iface != ifa.ifa_name) return true;
    if (ifa.ifa_addr->sa_family == AF_INET) {
      if (v4.empty()) v4 = numeric_address(ifa.ifa_addr);
    } else if (v6.empty() &&
               !IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(ifa.ifa_addr)->sin6_addr)) {
      v6 = numeric_address(ifa.ifa_addr);
    }
    return v4.empty();  // an IPv4 address ends the search: it is preferred
  });
  return v4.empty() ? v6 : v4;
}

std::string interface_reaching(const std::string& host) {
  return interface_with_address(local_address_reaching(host));
}

}  // namespace hemiola
