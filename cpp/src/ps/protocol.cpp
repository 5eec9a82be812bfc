#include "ps/protocol.h"

#include "hemiola/status.h"

namespace hemiola::ps {

const char* message_type_name(uint16_t type) {
  switch (static_cast<MessageType>(type)) {
    case MessageType::kRegister: return "register";
    case MessageType::kInit: return "init";
    case MessageType::kPush: return "push";
    case MessageType::kPushNone: return "push-none";
    case MessageType::kPull: return "pull";
    case MessageType::kSnapshot: return "snapshot";
    case MessageType::kBye: return "bye";
    case MessageType::kPing: return "ping";
    case MessageType::kHello: return "hello";
    case MessageType::kRegistered: return "registered";
    case MessageType::kPullReply: return "pull-reply";
    case MessageType::kPushAck: return "push-ack";
    case MessageType::kSnapshotDone: return "snapshot-done";
    case MessageType::kError: return "error";
    case MessageType::kWelcome: return "welcome";
  }
  return "unknown";
}

std::string header_problem(const Header& h) {
  if (h.magic != kMagic) return "bad magic (not a hemiola parameter-server message)";
  if (h.protocol != kProtocolVersion)
    return detail::concat("protocol version ", h.protocol, ", expected ", kProtocolVersion);
  if (h.checksum != header_checksum(h)) return "header checksum mismatch (garbled message)";
  if (std::string(message_type_name(h.type)) == "unknown")
    return detail::concat("unknown message type ", h.type);
  if (h.payload_bytes < 0 || h.payload_bytes > kMaxPayloadBytes)
    return detail::concat("payload of ", h.payload_bytes, " bytes is out of range");
  return {};
}

std::vector<char> frame(const Header& h, const std::vector<char>& payload) {
  std::vector<char> bytes(sizeof(Header) + payload.size());
  std::memcpy(bytes.data(), &h, sizeof(Header));
  if (!payload.empty()) std::memcpy(bytes.data() + sizeof(Header), payload.data(), payload.size());
  return bytes;
}

Header hello_header(int worker, const std::string& token) {
  Header h;
  h.type = static_cast<uint16_t>(MessageType::kHello);
  h.worker = worker;
  h.payload_bytes = static_cast<int64_t>(token.size());
  h.checksum = header_checksum(h);
  return h;
}

}  // namespace hemiola::ps
