#include "ps/snapshot.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "hemiola/status.h"
#include "optim/grad_norm.h"

namespace hemiola::ps {

namespace {

constexpr char kFileMagic[8] = {'H', 'M', 'P', 'S', 'S', 'N', 'A', 'P'};
// Format 2: magic, format, the file's total size, the body, then an FNV-1a
// checksum of everything before it. The size tells a truncated file from a
// corrupted one; the checksum catches any flipped byte.
constexpr uint32_t kFormat = 2;
constexpr size_t kPrefixBytes = sizeof kFileMagic + sizeof(uint32_t) + sizeof(uint64_t);

class Writer {
 public:
  template <typename T>
  void put(const T& value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  void put_floats(const std::vector<float>& values) {
    put<uint64_t>(values.size());
    out_.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  }
  void put_string(const std::string& s) {
    put<uint64_t>(s.size());
    out_.append(s);
  }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const std::string& bytes, const std::string& path) : in_(bytes), path_(path) {}
  template <typename T>
  T get() {
    T value;
    need(sizeof value);
    std::memcpy(&value, in_.data() + at_, sizeof value);
    at_ += sizeof value;
    return value;
  }
  std::vector<float> get_floats() {
    const auto n = get<uint64_t>();
    // Checked before multiplying: a count near 2^62 would wrap n * 4.
    if (n > (in_.size() - at_) / sizeof(float)) {
      HEMIOLA_THROW(ErrorCode::kInvalidArgument, "snapshot ", path_, " claims ", n,
                    " values where ", in_.size() - at_, " bytes remain; refusing to load it");
    }
    std::vector<float> values(n);
    std::memcpy(values.data(), in_.data() + at_, n * sizeof(float));
    at_ += n * sizeof(float);
    return values;
  }
  size_t remaining() const { return in_.size() - at_; }
  std::string get_string() {
    const auto n = get<uint64_t>();
    need(n);
    std::string s = in_.substr(at_, n);
    at_ += n;
    return s;
  }

 private:
  void need(uint64_t n) {
    if (n > in_.size() - at_)  // (at_ <= size always: no overflow)
      HEMIOLA_THROW(ErrorCode::kInvalidArgument, "snapshot ", path_, " is truncated");
  }
  const std::string& in_;
  const std::string& path_;
  size_t at_ = 0;
};

}  // namespace

uint64_t snapshot_checksum(const std::string& bytes) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

void write_snapshot(const std::string& path, const ServerSnapshot& s) {
  Writer w;
  w.bytes().append(kFileMagic, sizeof kFileMagic);
  w.put(kFormat);
  w.put<uint64_t>(0);  // the total size, filled in below
  w.put(s.server_index);
  w.put(s.num_servers);
  w.put_string(s.table);
  w.put<uint64_t>(s.keys.size());
  for (const auto& k : s.keys) {
    w.put(k.key);
    w.put(k.version);
    w.put_floats(k.param);
    w.put(static_cast<int32_t>(k.optimizer.kind));
    w.put(k.optimizer.step);
    w.put<uint8_t>(k.optimizer.has_momentum ? 1 : 0);
    w.put_floats(k.optimizer.m);
    w.put_floats(k.optimizer.v);
  }
  const uint64_t total = w.bytes().size() + sizeof(uint64_t);
  std::memcpy(&w.bytes()[sizeof kFileMagic + sizeof kFormat], &total, sizeof total);
  w.put(snapshot_checksum(w.bytes()));

  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    HEMIOLA_CHECK(out.good(), "cannot write snapshot ", tmp);
    out.write(w.bytes().data(), static_cast<std::streamsize>(w.bytes().size()));
    out.flush();
    HEMIOLA_CHECK(out.good(), "writing snapshot ", tmp, " failed (disk full?)");
  }
  HEMIOLA_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path);
}

namespace {

// A hand-made file can carry a valid checksum: every field is checked for
// what the server will do with it, naming the file and the key.
void check_snapshot(const std::string& path, const ServerSnapshot& s) {
  HEMIOLA_CHECK(s.num_servers >= 1 && s.server_index >= 0 && s.server_index < s.num_servers,
                "snapshot ", path, " is for server ", s.server_index, " of ", s.num_servers,
                ", which is not a server index; refusing to load it");
  std::set<int32_t> seen;
  for (const auto& k : s.keys) {
    const std::string where = "snapshot " + path + " key " + std::to_string(k.key);
    HEMIOLA_CHECK(k.key >= 0 && seen.insert(k.key).second, where,
                  " is negative or appears twice; refusing to load it");
    HEMIOLA_CHECK(k.version >= 0 && k.optimizer.step >= 0, where, " has version ", k.version,
                  " and step ", k.optimizer.step, " (negative); refusing to load it");
    const auto kind = static_cast<int32_t>(k.optimizer.kind);
    HEMIOLA_CHECK(kind >= 0 && kind <= 2, where, " has optimizer kind ", kind,
                  " (known: 0 SGD, 1 Adam, 2 AdamW); refusing to load it");
    // SGD: a momentum buffer exactly when has_momentum; Adam/AdamW: both
    // moments, or neither before the first step.
    const size_t n = k.param.size();
    const size_t m = k.optimizer.m.size();
    const bool consistent =
        k.optimizer.kind == OptimizerKind::kSgd
            ? m == (k.optimizer.has_momentum ? n : 0) && k.optimizer.v.empty()
            : (m == 0 || m == n) && k.optimizer.v.size() == m;
    HEMIOLA_CHECK(consistent, where,
                  " has ", n, " parameters but optimizer state of ", k.optimizer.m.size(),
                  " and ", k.optimizer.v.size(), " values; refusing to load it");
    for (const auto* values : {&k.param, &k.optimizer.m, &k.optimizer.v}) {
      HEMIOLA_CHECK(optim::all_finite(values->data(), static_cast<std::int64_t>(values->size()),
                                      DType::kFloat32),
                    where, " holds a non-finite ",
                    values == &k.param ? "parameter" : "optimizer state",
                    " value; refusing to load it");
    }
  }
}

}  // namespace

ServerSnapshot read_snapshot(const std::string& path) {
  std::error_code ec;
  HEMIOLA_CHECK(!std::filesystem::is_directory(path, ec), "snapshot ", path,
                " is a directory; snapshot_path names a file (each server's own)");
  std::ifstream in(path, std::ios::binary);
  HEMIOLA_CHECK(in.good(), "snapshot ", path, " does not exist or cannot be read");
  std::string bytes;
  try {
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::exception& e) {
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "snapshot ", path, " cannot be read: ", e.what());
  }
  HEMIOLA_CHECK(!in.bad(), "snapshot ", path, " cannot be read (I/O error)");
  HEMIOLA_CHECK(bytes.size() >= sizeof kFileMagic &&
                    std::memcmp(bytes.data(), kFileMagic, sizeof kFileMagic) == 0,
                "snapshot ", path, " is not a hemiola parameter-server snapshot (", bytes.size(),
                " bytes, no magic); refusing to load it");
  HEMIOLA_CHECK(bytes.size() >= kPrefixBytes + sizeof(uint64_t), "snapshot ", path,
                " is truncated (", bytes.size(), " bytes); refusing to load it");
  uint32_t format = 0;
  uint64_t total = 0;
  std::memcpy(&format, bytes.data() + sizeof kFileMagic, sizeof format);
  std::memcpy(&total, bytes.data() + sizeof kFileMagic + sizeof format, sizeof total);
  HEMIOLA_CHECK(format == kFormat, "snapshot ", path, " has format ", format, ", expected ",
                kFormat, " (written by another hemiola version?); refusing to load it");
  HEMIOLA_CHECK(bytes.size() >= total, "snapshot ", path, " is truncated (", bytes.size(),
                " of ", total, " bytes); refusing to load it");
  HEMIOLA_CHECK(bytes.size() == total, "snapshot ", path, " has ", bytes.size() - total,
                " trailing bytes after its end; refusing to load it");
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - sizeof stored, sizeof stored);
  const std::string body = bytes.substr(0, bytes.size() - sizeof stored);
  HEMIOLA_CHECK(snapshot_checksum(body) == stored, "snapshot ", path,
                " is corrupted (checksum mismatch); refusing to load it");

  Reader r(body, path);
  for (size_t i = 0; i < kPrefixBytes; ++i) r.get<char>();
  ServerSnapshot s;
  s.server_index = r.get<int32_t>();
  s.num_servers = r.get<int32_t>();
  s.table = r.get_string();
  const auto n = r.get<uint64_t>();
  // A key takes at least its fixed fields: a count beyond that is a lie,
  // refused before it sizes a vector.
  constexpr size_t kMinKeyBytes = 4 + 8 + 8 + 4 + 8 + 1 + 8 + 8;
  HEMIOLA_CHECK(n <= r.remaining() / kMinKeyBytes, "snapshot ", path, " claims ", n,
                " keys in ", r.remaining(), " bytes; refusing to load it");
  s.keys.resize(n);
  for (auto& k : s.keys) {
    k.key = r.get<int32_t>();
    k.version = r.get<int64_t>();
    k.param = r.get_floats();
    k.optimizer.kind = static_cast<OptimizerKind>(r.get<int32_t>());
    k.optimizer.step = r.get<int64_t>();
    const auto has_momentum = r.get<uint8_t>();
    HEMIOLA_CHECK(has_momentum <= 1, "snapshot ", path, " key ", k.key,
                  " has a momentum flag of ", int{has_momentum}, "; refusing to load it");
    k.optimizer.has_momentum = has_momentum == 1;
    k.optimizer.m = r.get_floats();
    k.optimizer.v = r.get_floats();
  }
  check_snapshot(path, s);
  return s;
}

}  // namespace hemiola::ps
