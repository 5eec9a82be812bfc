// The wire format between parameter-server workers and servers.
//
// One TCP connection per (server, worker) pair carries messages, each a
// fixed-size Header followed by `payload_bytes` bytes of payload. The header
// carries a per-direction sequence number and a checksum, so a receiver can
// reject a garbled, replayed or reordered message instead of applying it.
// A connection begins with a handshake outside the numbered stream: the worker
// sends kHello (payload: the job token), the server answers kWelcome or kError
// and closes; nothing else is read from a connection that has not said hello.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "hemiola/ps.h"

namespace hemiola::ps {

constexpr uint32_t kMagic = 0x53504d48;  // "HMPS"
// 2: a registration carries the worker's optimizer settings (ps/table.h).
constexpr uint16_t kProtocolVersion = 2;
// Payloads larger than this are a protocol violation, never an allocation.
constexpr int64_t kMaxPayloadBytes = int64_t(1) << 32;
// A hello carries only the job token: anything longer is hostile.
constexpr int64_t kMaxHelloBytes = 4096;

enum class MessageType : uint16_t {
  // worker -> server
  kRegister = 1,   // payload: the worker's shard table for this server and its optimizer
                   // settings (ps/table.h's Registration); aux = consistency
  kInit = 2,       // payload: initial float32 values of one key (worker 0 only)
  kPush = 3,       // payload: float32 gradient of one key; version = computed on
  kPushNone = 4,   // no gradient this iteration for the key
  kPull = 5,       // version = the smallest version the worker may receive (bsp);
                   // kFlagAhead (eager): the own push follows, aux = the staleness
                   // of the previous one
  kSnapshot = 6,   // write a snapshot now
  kBye = 7,        // the worker is done
  kPing = 8,       // either direction: "still here" (handled inside Channel)
  kHello = 9,      // the handshake: worker = its index, payload = the job token
  // server -> worker
  kRegistered = 20,    // aux = 1 when the server restored its state from a snapshot
  kPullReply = 21,     // payload: float32 values; version = their version
  kPushAck = 22,       // version = computed on, aux = applied at, factor = lr factor
  kSnapshotDone = 23,
  kError = 24,         // payload: the message; the worker must stop
  kWelcome = 25,       // the handshake succeeded
};

const char* message_type_name(uint16_t type);

struct Header {
  uint32_t magic = kMagic;
  uint16_t protocol = kProtocolVersion;
  uint16_t type = 0;
  uint64_t seq = 0;  // set by the channel: 0, 1, 2, ... per direction
  int32_t key = -1;
  int32_t worker = -1;
  int64_t version = 0;
  int64_t aux = 0;
  int64_t payload_bytes = 0;
  double hyper[7] = {};  // lr, momentum, dampening, weight_decay, beta1, beta2, eps
  int32_t flags = 0;     // kFlag* below
  int32_t optimizer = 0;
  int32_t rule = 0;      // the worker's StalenessRule
  int32_t momentum_rule = 0;  // the worker's MomentumRule
  double factor = 1.0;
  uint64_t checksum = 0;  // set by the channel: FNV-1a of the header with this field zero
};
static_assert(std::is_trivially_copyable_v<Header>);
constexpr int32_t kFlagNesterov = 1;
constexpr int32_t kFlagNoGradient = 2;
constexpr int32_t kFlagAhead = 4;

inline uint64_t header_checksum(Header h) {
  h.checksum = 0;
  uint64_t hash = 1469598103934665603ull;
  const auto* bytes = reinterpret_cast<const unsigned char*>(&h);
  for (size_t i = 0; i < sizeof h; ++i) {
    hash ^= bytes[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

inline void put_hyper(Header& h, const OptimizerHyper& hp) {
  const double values[7] = {hp.lr, hp.momentum, hp.dampening, hp.weight_decay,
                            hp.beta1, hp.beta2, hp.eps};
  std::memcpy(h.hyper, values, sizeof values);
  h.flags = hp.nesterov ? (h.flags | kFlagNesterov) : (h.flags & ~kFlagNesterov);
}

inline OptimizerHyper get_hyper(const Header& h) {
  OptimizerHyper hp;
  hp.lr = h.hyper[0];
  hp.momentum = h.hyper[1];
  hp.dampening = h.hyper[2];
  hp.weight_decay = h.hyper[3];
  hp.beta1 = h.hyper[4];
  hp.beta2 = h.hyper[5];
  hp.eps = h.hyper[6];
  hp.nesterov = (h.flags & kFlagNesterov) != 0;
  return hp;
}

// Empty when the header is well formed (magic, protocol, checksum, type,
// payload size within limits); otherwise why not.
std::string header_problem(const Header& h);

// A message as it goes on the wire: the header's bytes, then the payload's.
std::vector<char> frame(const Header& h, const std::vector<char>& payload);

// Both sides' view of a hello header (tests use it to craft hostile ones).
Header hello_header(int worker, const std::string& token);

}  // namespace hemiola::ps
